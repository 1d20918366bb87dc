"""Load and memory signals read from outside the gateway, off the request path.

Per engine, every ``scrape_interval_s``:

* the engine's own Prometheus endpoint (vLLM: ``vllm:kv_cache_usage_perc``,
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and the
  ``vllm:time_to_first_token_seconds`` histogram, whose P99 over the window is
  computed from bucket deltas as PromQL's ``histogram_quantile`` does);
* optionally GPU memory: a DCGM exporter (``DCGM_FI_DEV_FB_USED`` / ``_FREE``),
  a PromQL query against a Prometheus server, or NVML when the gateway shares the host;
* from the same DCGM exporter or NVML, the GPUs' power draw (``DCGM_FI_DEV_POWER_USAGE``,
  ``nvmlDeviceGetPowerUsage``), summed over the engine's GPUs as ``power_watts``, which the
  controller integrates into energy per token (:mod:`engines.rollout.energy`).

``vram_usage`` is the GPU memory ratio when one of those sources is configured;
otherwise it falls back to vLLM's KV-cache usage, since vLLM reserves its share of
GPU memory up front and pressure inside it shows as KV-cache use.

``vram_used_bytes`` is the GPU memory the engine's GPUs use, in bytes, summed over them (DCGM's
``DCGM_FI_DEV_FB_USED`` is in MiB; NVML answers bytes): the absolute budget of a deployment
(peak VRAM for BF16) is read against it, beside the ratio.

Only the controller's leader scrapes. It exports what it read as the gauges
``omnigate_engine_vram_usage_ratio``, ``omnigate_engine_vram_used_bytes`` and
``omnigate_engine_kv_cache_usage_ratio``;
a reading the controller no longer trusts (see :meth:`TelemetryCollector.latest`),
or a replica that stops leading, removes them rather than leave a stale value.

Its length: the parsers of each source's text (vLLM, vLLM-Omni, DCGM, Prometheus queries, NVML) sit
beside the collector that reads them, so one reading's path from scrape to gauge is in one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog
from prometheus_client.parser import text_string_to_metric_families

from engines.rollout.settings import EngineTelemetry, SignalSettings
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

KV_CACHE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TTFT_HIST = "vllm:time_to_first_token_seconds"
# vLLM-Omni (with --log-stats): its own pipeline-wide gauges, and vLLM's families once per stage and replica.
OMNI_RUNNING = "vllm_omni:num_requests_running"
OMNI_WAITING = "vllm_omni:num_requests_waiting"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
POWER = "DCGM_FI_DEV_POWER_USAGE"
_MIB = float(1 << 20)  # DCGM reports framebuffer memory in MiB


# -- parsing (pure) ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class VllmReading:
    kv_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    #: cumulative TTFT histogram summed over label sets: upper bound -> count
    ttft_buckets: dict[float, float] | None = None


# vLLM-Omni 0.30.0 labels a stage by its id (its place in the deploy config); builds and dashboards that
# label it by name say "thinker" for the same stage. Qwen3-Omni's stages, id and name, in pipeline order.
_STAGE_NAMES = (("0", "thinker"), ("1", "talker"), ("2", "code2wav"))


def stage_labels(stage: str) -> frozenset[str]:
    """The ``stage`` label values that mean the configured stage: its id and its name, whichever is given."""
    for pair in _STAGE_NAMES:
        if stage.lower() in pair:
            return frozenset(pair)
    return frozenset({stage})


def _of_stage(samples: list[Any], stage: str) -> list[Any]:
    """vLLM-Omni labels vLLM's series per ``stage``: one request is counted once per stage it passes, and the
    stages' latencies differ in kind, so only ``stage``'s series are read (summed over its replicas)."""
    if not any("stage" in s.labels for s in samples):
        return samples
    wanted = stage_labels(stage)
    return [s for s in samples if s.labels.get("stage", "").lower() in wanted]


def _stage_sum(samples: list[Any], stage: str) -> float | None:
    """The sum over ``stage``'s series; None when the series are per stage but ``stage`` is not among them."""
    picked = _of_stage(samples, stage)
    return sum(s.value for s in picked) if picked or not samples else None


def parse_vllm(text: str, stage: str = "0") -> VllmReading:
    """vLLM's gauges (summed over label sets; KV-cache usage: the fullest) and its TTFT histogram.

    From vLLM-Omni: request counts from its ``vllm_omni:*`` gauges where it sends them, otherwise
    (like the TTFT histogram) from the ``stage`` stage's series only; KV-cache usage is the fullest stage's.
    """
    out = VllmReading()
    omni: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in (OMNI_RUNNING, OMNI_WAITING):
            omni[fam.name] = sum(s.value for s in fam.samples)
        elif fam.name == KV_CACHE:
            out.kv_cache_usage = max((s.value for s in fam.samples), default=None)
        elif fam.name == RUNNING:
            out.requests_running = _stage_sum(fam.samples, stage)
        elif fam.name == WAITING:
            out.requests_waiting = _stage_sum(fam.samples, stage)
        elif fam.name == TTFT_HIST and fam.type == "histogram":
            buckets: dict[float, float] = {}
            for s in _of_stage(fam.samples, stage):
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
            out.ttft_buckets = buckets or None
    out.requests_running = omni.get(OMNI_RUNNING, out.requests_running)
    out.requests_waiting = omni.get(OMNI_WAITING, out.requests_waiting)
    return out


def parse_dcgm(text: str, gpus: Iterable[str] = ()) -> float | None:
    """GPU framebuffer use as a 0..1 ratio over the selected GPUs (all when none are named)."""
    wanted = set(gpus)
    used = free = 0.0
    seen = False
    for fam in text_string_to_metric_families(text):
        if fam.name not in (FB_USED, FB_FREE):
            continue
        for s in fam.samples:
            if wanted and s.labels.get("gpu") not in wanted and s.labels.get("UUID") not in wanted:
                continue
            seen = True
            if fam.name == FB_USED:
                used += s.value
            else:
                free += s.value
    if not seen or used + free <= 0:
        return None
    return used / (used + free)


def _dcgm_sum(text: str, family: str, gpus: Iterable[str]) -> float | None:
    """One DCGM family summed over the selected GPUs (all GPUs when none are named); None: not exported."""
    wanted = set(gpus)
    total = 0.0
    seen = False
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if wanted and s.labels.get("gpu") not in wanted and s.labels.get("UUID") not in wanted:
                continue
            if s.value == s.value:  # not NaN
                seen = True
                total += s.value
    return total if seen else None


def parse_dcgm_power(text: str, gpus: Iterable[str] = ()) -> float | None:
    """The selected GPUs' power draw in watts, summed (all GPUs when none are named); None: not exported."""
    return _dcgm_sum(text, POWER, gpus)


def parse_dcgm_used_bytes(text: str, gpus: Iterable[str] = ()) -> float | None:
    """GPU framebuffer in use, in bytes, summed over the selected GPUs (all when none are named)."""
    used = _dcgm_sum(text, FB_USED, gpus)
    return None if used is None else used * _MIB


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over cumulative buckets (linear inside the bucket)."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    if not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound  # in the +Inf bucket: the highest finite bound, as Prometheus answers
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return prev_bound


def bucket_delta(now: dict[float, float], then: dict[float, float] | None) -> dict[float, float]:
    if not then or any(now.get(le, 0.0) < c for le, c in then.items()):
        return dict(now)  # first reading, or the engine restarted (counters reset)
    return {le: c - then.get(le, 0.0) for le, c in now.items()}


# -- the collector -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Target:
    name: str
    metrics_url: str | None
    telemetry: EngineTelemetry


class TelemetryCollector:
    """Scrapes every engine's sources; :meth:`latest` gives the fresh values as controller signals."""

    def __init__(
        self,
        engines: Iterable[tuple[str, str | None, EngineTelemetry]],
        settings: SignalSettings,
        metrics: Metrics,
        active: Callable[[], bool] = lambda: True,
        variants: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self._variants = dict(variants or {})
        self._metrics = metrics
        self._active = active
        self._targets = [_Target(n, url, t) for n, url, t in engines]
        self._latest: dict[str, tuple[float, dict[str, float]]] = {}
        self._ttft_hist: dict[str, deque[tuple[float, dict[float, float]]]] = {
            t.name: deque() for t in self._targets
        }
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._nvml: Any = None

    @staticmethod
    def metrics_url_for(base_url: str | None, telemetry: EngineTelemetry) -> str | None:
        if not telemetry.scrape:
            return None
        if telemetry.metrics_url is not None:
            return str(telemetry.metrics_url)
        if base_url is None:
            return None
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        return root + "/metrics"

    @property
    def wanted(self) -> bool:
        return any(
            t.metrics_url or t.telemetry.dcgm_url or t.telemetry.nvml or t.telemetry.vram_query
            for t in self._targets
        )

    @property
    def measures_power(self) -> bool:
        """Some engine has a power source (DCGM or NVML): energy per token can be measured."""
        return any(t.telemetry.dcgm_url or t.telemetry.nvml for t in self._targets)

    async def start(self) -> None:
        if not self.wanted:
            return
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run(), name="telemetry-scrape")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # NVML already gone: nothing to release
                self._nvml.nvmlShutdown()

    async def _run(self) -> None:
        while True:
            if self._active():
                await self.collect_once()
            else:
                self._unexport()
            await asyncio.sleep(self.settings.scrape_interval_s)

    def latest(self, name: str) -> dict[str, float]:
        """The engine's last readings, or nothing when they are older than three scrape intervals."""
        entry = self._latest.get(name)
        if entry is None or time.monotonic() - entry[0] > 3 * self.settings.scrape_interval_s + 1:
            return {}
        return dict(entry[1])

    async def collect_once(self) -> None:
        await asyncio.gather(*(self._collect(t) for t in self._targets))

    async def _collect(self, t: _Target) -> None:
        values: dict[str, float] = {}
        if t.metrics_url:
            try:
                reading = parse_vllm(await self._get_text(t.metrics_url), t.telemetry.stage)
            except Exception as exc:
                self._failed(t.name, "engine", exc)
            else:
                for key in ("kv_cache_usage", "requests_running", "requests_waiting"):
                    v = getattr(reading, key)
                    if v is not None:
                        values[key] = float(v)
                if reading.ttft_buckets is not None:
                    p99 = self._window_p99(t.name, reading.ttft_buckets)
                    if p99 is not None:
                        values["engine_ttft_p99"] = p99
        vram: list[float] = []
        used_bytes: list[float] = []
        tel = t.telemetry
        power: float | None = None
        if tel.dcgm_url is not None:
            try:
                text = await self._get_text(str(tel.dcgm_url))
                ratio = parse_dcgm(text, tel.gpus)
                used = parse_dcgm_used_bytes(text, tel.gpus)
                power = parse_dcgm_power(text, tel.gpus)
            except Exception as exc:
                self._failed(t.name, "dcgm", exc)
            else:
                if ratio is not None:
                    vram.append(ratio)
                if used is not None:
                    used_bytes.append(used)
        if tel.vram_query is not None and self.settings.prometheus_url is not None:
            try:
                ratio = await self._prometheus_query(tel.vram_query)
            except Exception as exc:
                self._failed(t.name, "prometheus", exc)
            else:
                if ratio is not None:
                    vram.append(ratio)
        if tel.nvml:
            try:
                used_b, total_b, nvml_power = await asyncio.to_thread(self._nvml_read, tel.gpus)
            except Exception as exc:
                self._failed(t.name, "nvml", exc)
            else:
                if total_b:
                    vram.append(used_b / total_b)
                    used_bytes.append(float(used_b))
                if power is None:
                    power = nvml_power
        if used_bytes:
            values["vram_used_bytes"] = max(used_bytes)  # two sources read the same GPUs: the larger
        if vram:
            values["vram_usage"] = max(vram)
        elif "kv_cache_usage" in values:
            values["vram_usage"] = values["kv_cache_usage"]
        if power is not None:
            values["power_watts"] = power
        if values:
            self._latest[t.name] = (time.monotonic(), values)
        self._export(t.name)

    def _export(self, name: str) -> None:
        """The readings the controller sees now, as gauges; one it would not use is removed, not left stale."""
        values = self.latest(name)
        m = self._metrics
        for gauge, key in ((m.engine_vram, "vram_usage"), (m.engine_kv_cache, "kv_cache_usage")):
            if key in values:
                gauge.labels(name).set(values[key])
            else:
                gauge.remove(name)
        variant = self._variants.get(name, "")
        if "vram_used_bytes" in values:
            m.engine_vram_bytes.labels(name, variant).set(values["vram_used_bytes"])
        else:
            m.engine_vram_bytes.remove(name, variant)

    def _unexport(self) -> None:
        for t in self._targets:
            self._metrics.engine_vram.remove(t.name)
            self._metrics.engine_kv_cache.remove(t.name)
            self._metrics.engine_vram_bytes.remove(t.name, self._variants.get(t.name, ""))

    def _failed(self, engine: str, source: str, exc: Exception) -> None:
        self._metrics.scrape_errors.labels(engine, source).inc()
        log.debug("telemetry_read_failed", engine=engine, source=source, error=str(exc) or type(exc).__name__)

    async def _get_text(self, url: str) -> str:
        assert self._session is not None
        async with self._session.get(url) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url} answered {resp.status}")
            return await resp.text()

    def _window_p99(self, name: str, buckets: dict[float, float]) -> float | None:
        hist = self._ttft_hist[name]
        now = time.monotonic()
        hist.append((now, buckets))
        horizon = now - self.settings.window_s
        while len(hist) > 1 and hist[1][0] <= horizon:
            hist.popleft()
        base = hist[0][1] if len(hist) > 1 else None
        return histogram_quantile(0.99, bucket_delta(buckets, base))

    async def _prometheus_query(self, query: str) -> float | None:
        assert self._session is not None and self.settings.prometheus_url is not None
        url = str(self.settings.prometheus_url).rstrip("/") + "/api/v1/query"
        async with self._session.get(url, params={"query": query}) as resp:
            body = orjson.loads(await resp.read())
        if body.get("status") != "success":
            raise RuntimeError(body.get("error") or "query failed")
        data = body["data"]
        if data["resultType"] == "scalar":
            return float(data["result"][1])
        values = [float(r["value"][1]) for r in data["result"]]
        values = [v for v in values if not math.isnan(v)]
        return max(values) if values else None

    def _nvml_read(self, gpus: list[str]) -> tuple[int, int, float | None]:
        """Bytes used, bytes in all and power draw in watts over the engine's GPUs (all when none are
        named); power None where a GPU has no power reading."""
        import pynvml  # the nvidia-ml-py package

        if self._nvml is None:
            pynvml.nvmlInit()
            self._nvml = pynvml
        indices = [int(g) for g in gpus] if gpus else list(range(pynvml.nvmlDeviceGetCount()))
        used = total = 0
        milliwatts: float | None = 0.0
        for i in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            used += info.used
            total += info.total
            try:
                if milliwatts is not None:
                    milliwatts += pynvml.nvmlDeviceGetPowerUsage(handle)
            except pynvml.NVMLError:  # a GPU without power readings: no energy figure, memory still read
                milliwatts = None
        return used, total, (milliwatts / 1000.0 if milliwatts is not None and indices else None)
