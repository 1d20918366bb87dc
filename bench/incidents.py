"""Incident replay: drive scripted engines into incidents under steady load and time the rollback.

    python -m bench.incidents [--rate 20] [--only spike,noise] [--tiny | --smoke] [--out FILE]

Three scripted vLLM-Omni engines (INT4 primary, INT8 and BF16 fallbacks), each its
own process (``python -m tests.upstream``), behind a fresh gateway process per
scenario with the seeds' thresholds (P99 TTFT 600 ms, VRAM 90 %, WER 5 %) and time
constants divided by ten (for 3 s instead of 30 s, a 10 s window), so a scenario
takes seconds. An open-loop load generator sends ``--rate`` streamed requests a
second. Per scenario it reports:

* time to detect: fault injected -> the controller first saw the condition
  (the transition's ``detected_at``; for a crash, the circuit's ejection);
* time to switch: fault injected -> the routing table changed;
* failed requests: non-200 answers and error frames while the scenario ran;
* switches: automatic routing transitions during the scenario.

The energy and accuracy incidents (their layouts and faults in ``bench/energy_incidents.py``)
change the engines' roles and rules for their scenario. INT4 and BF16 share GPU "0" (INT8
is on "1"), so the VRAM rule also puts the idle BF16 to sleep (the scripted engines serve
vLLM-Omni's /v1/omni/sleep and /v1/omni/wakeup). ``--tiny`` shortens every phase (long enough
for an incident to play out); ``--smoke`` shortens them further and, without ``--only``, runs
the energy incident (its layout, preparation and fault from ``bench/energy_incidents.py``).
Neither gives figures to quote.

Its length: one harness and its twelve incidents, each a few lines, kept together so a run is one command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    scripted_upstream,
    smoke_result,
    spawn,
    wait_http,
)
from bench.energy_incidents import (
    accuracy_inject,
    accuracy_layout,
    accuracy_prepare,
    energy_inject,
    energy_layout,
    energy_prepare,
    power,
)

ADMIN_KEY = secrets.token_hex(32)  # the boot refuses typed keys
MODEL = "qwen3-omni-flash"
VARIANTS = ("int4", "int8", "bf16")
GPUS = {"int4": "0", "int8": "1", "bf16": "0"}
CHINESE = "您好，请问有什么可以帮您？我们的客服代表马上为您服务，请稍等。"
ROUTING_ACTIONS = ("shift", "set_weight", "limit_concurrency", "raise_concurrency", "restore", "eject")


@dataclass
class Result:
    scenario: str
    expected: str
    requests: int = 0
    failed: int = 0
    detect_s: float | None = None
    switch_s: float | None = None
    switches: int = 0
    actions: list[str] = field(default_factory=list)
    after_switch_to_int4: int | None = None
    #: the highest INT4 signal the controller saw during the scenario (the one the rule watches)
    peak_signal: float | None = None
    trigger_value: float | None = None
    note: str = ""
    #: where the first shift sent the traffic
    targets: dict | None = None


class Upstreams:
    def __init__(self) -> None:
        self.ports = {v: free_port() for v in VARIANTS}
        self.procs: dict[str, Any] = {}

    def start(self, variant: str) -> None:
        self.procs[variant] = scripted_upstream(self.ports[variant], "omni", 1)

    async def start_all(self) -> None:
        for v in VARIANTS:
            self.start(v)
        for v in VARIANTS:
            await wait_http(self.url(v) + "/health")

    def url(self, v: str) -> str:
        return f"http://127.0.0.1:{self.ports[v]}"

    def kill(self, v: str) -> None:
        p = self.procs.pop(v)
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def stop_all(self) -> None:
        for v in list(self.procs):
            p = self.procs.pop(v)
            p.terminate()
            p.wait(10)

    async def post(self, s: aiohttp.ClientSession, v: str, path: str, body: Any) -> None:
        async with s.post(self.url(v) + path, data=orjson.dumps(body)) as r:
            if r.status != 200:
                raise RuntimeError(f"{v}{path}: {r.status} {await r.text()}")

    async def script(self, s: aiohttp.ClientSession, v: str, **fields: Any) -> None:
        await self.post(s, v, "/_script", {"flavour": "omni", **fields})

    async def reset(self, s: aiohttp.ClientSession, speech: list | None = None) -> None:
        for v in VARIANTS:
            extra = {}
            if speech:
                said, own, _ = speech[0]
                extra = {"text": said, "audio_wav": str(own)}
            await self.script(s, v, first_byte_delay_s=0.2, **extra)
            await self.post(s, v, "/_metrics", {"kv_cache_usage_perc": 0.3, "num_requests_running": None})
            await self.post(s, v, "/v1/omni/wakeup", {"stage_ids": [0, 1, 2]})  # awake, whatever came before


def gateway_config(
    ups: Upstreams,
    port: int,
    sentinel: bool,
    caps: dict[str, int] | None = None,
    tweak: Callable[[dict], None] | None = None,
) -> dict:
    cfg = _gateway_config(ups, port, sentinel, caps)
    if tweak is not None:
        tweak(cfg)
    return cfg


def _gateway_config(ups: Upstreams, port: int, sentinel: bool, caps: dict[str, int] | None) -> dict:
    engines = []
    for v, role in zip(VARIANTS, ("primary", "fallback", "fallback"), strict=True):
        engines.append(
            {
                "name": f"omni-{v}",
                "kind": "vllm-omni",
                "base_url": ups.url(v) + "/v1",
                "model": f"qwen3-omni-{v}",
                "variant": v,
                "role": role,
                "serves": [MODEL],
                "first_byte_timeout_s": 10,
                "read_timeout_s": 10,
                "telemetry": {"gpus": [GPUS[v]]},
                **({"max_in_flight": caps[v]} if caps else {}),
            }
        )
    # The seeds' thresholds; durations divided by ten.
    rules = [
        {
            "name": "int4-latency",
            "select": {"variants": ["int4"]},
            "signal": "upstream_ttft_p99",  # the engine's, as the default rule (queueing is not INT4's fault)
            "above": 0.6,
            "for_s": 3,
            "min_samples": 20,
            "recover_below": 0.45,
            "recover_for_s": 30,
            "action": {"kind": "shift", "to_variants": ["fp16", "bf16"], "trickle_weight": 0.05},
        },
        {
            "name": "vram-pressure",
            "signal": "vram_usage",
            "above": 0.9,
            "for_s": 3,
            "min_samples": 0,
            "recover_below": 0.8,
            "recover_for_s": 6,
            "action": {"kind": "limit_concurrency", "concurrency_factor": 0.5, "sleep_idle": True},
        },
        {
            "name": "latency-batch",
            "select": {"variants": ["int4"]},
            "signal": "ttft_p50",
            "above": 0.4,
            "for_s": 3,
            "min_samples": 20,
            "recover_below": 0.3,
            "recover_for_s": 12,
            "action": {"kind": "raise_concurrency", "raise_factor": 2.0, "max_concurrency": 8},
        },
        {
            "name": "wer-drift",
            "select": {"variants": ["int4"]},
            "signal": "wer",
            "above": 0.05,
            "for_s": 0,
            "min_samples": 5,
            "recover_below": 0.03,
            "recover_for_s": 60,
            "action": {"kind": "shift", "to_variants": ["int8", "fp16", "bf16"], "trickle_weight": 0.1},
        },
    ]
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "engines": engines,
        "admin": {"api_key": ADMIN_KEY},
        "auth": {"required": False},  # this bench drives routing, not the front door
        # The overload cap (4) wins over a raise while the gateway counts itself overloaded (16 in flight by
        # default), which the queueing scenario's backlog soon makes it: there the soft limit is lifted so the
        # raise is what is measured.
        **({"traffic": {"soft_limit": 64, "hard_limit": 256}} if caps else {}),
        "logging": {"level": "warning", "json": True},
        "routing": {
            "probe_interval_s": 1.0,
            "circuit": {"consecutive_failures": 5, "base_ejection_s": 5, "max_ejection_s": 30},
            "signals": {"window_s": 10, "scrape_interval_s": 0.5, "scrape_timeout_s": 1},
            "sentinel": {"enabled": sentinel, "sample_share": 0.25, "queue_size": 2, "window_s": 60},
            "controller": {
                "offload": {"retry_s": 3},
                "interval_s": 0.25,
                "min_dwell_s": 6,
                "cooldown_s": 12,
                "max_switches_per_hour": 6,
                "rules": rules,
            },
            "seed": 7,
        },
    }


def _code(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"].get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


class Load:
    """Open loop: one streamed request every 1/rate seconds, whatever the answers do."""

    def __init__(self, url: str, rate: float, speech: bool) -> None:
        self.url = url + "/v1/chat/completions"
        self.rate = rate
        body: dict = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        if speech:
            body |= {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
        self.body = orjson.dumps(body)
        self.records: list[tuple[float, bool]] = []
        #: why requests failed: HTTP status or error code -> count
        self.why: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    async def _one(self, s: aiohttp.ClientSession) -> None:
        t0 = time.time()
        ok = True
        try:
            async with s.post(self.url, data=self.body, headers={"content-type": "application/json"}) as r:
                if r.status != 200:
                    ok = False
                    body = await r.read()
                    self._fail(f"{r.status} {_code(body)}")
                else:
                    async for line in r.content:
                        if line.startswith(b'data: {"error"'):
                            ok = False
                            self._fail(f"frame {_code(line[6:])}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok = False
            self._fail(type(exc).__name__)
        self.records.append((t0, ok))

    def _fail(self, why: str) -> None:
        self.why[why] = self.why.get(why, 0) + 1

    async def run(self, s: aiohttp.ClientSession) -> None:
        interval = 1.0 / self.rate
        nxt = time.monotonic()
        while not self._stop.is_set():
            t = asyncio.create_task(self._one(s))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)

    def between(self, t0: float, t1: float) -> tuple[int, int]:
        rs = [ok for t, ok in self.records if t0 <= t <= t1]
        return len(rs), sum(1 for ok in rs if not ok)


async def admin_status(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/admin/routing", headers={"authorization": f"Bearer {ADMIN_KEY}"}) as r:
        return await r.json()


async def upstream_count(s: aiohttp.ClientSession, ups: Upstreams, v: str) -> int | None:
    if v not in ups.procs:
        return None  # crashed
    async with s.get(ups.url(v) + "/_stats") as r:
        return (await r.json())["requests"]


Inject = Callable[[aiohttp.ClientSession, Upstreams, float], Awaitable[None]]
After = Callable[[aiohttp.ClientSession, Upstreams, str, float, Result], Awaitable[None]]


async def run_scenario(
    name: str,
    expected: str,
    ups: Upstreams,
    inject: Inject,
    *,
    rate: float,
    warmup_s: float = 12.0,
    observe_s: float = 40.0,
    until_switch: bool = True,
    speech: list | None = None,
    after_s: float = 5.0,
    restart: str | None = None,
    watch: str = "upstream_ttft_p99",
    watch_engine: str = "int4",
    watch_low: bool = False,
    tweak: Callable[[dict], None] | None = None,
    prepare: Inject | None = None,
    note: str = "",
    caps: dict[str, int] | None = None,
    after: After | None = None,
) -> Result:
    res = Result(name, expected, note=note)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(gateway_config(ups, port, sentinel=speech is not None, caps=caps, tweak=tweak), f)
        cfg_path = f.name
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        await ups.reset(s, speech)
        if prepare is not None:
            await prepare(s, ups, time.time())
        gw = spawn(["-m", "gateway.cli", "serve", "--config", cfg_path], cpu=0)
        try:
            await wait_http(url + "/readyz", timeout=120)
            load = Load(url, rate, speech=speech is not None)
            runner = asyncio.create_task(load.run(s))
            await asyncio.sleep(warmup_s)
            early = [t for t in (await admin_status(s, url))["recent_transitions"] if t["source"] == "auto"]
            warm_note = (
                "switched during the warm-up, before any fault (a loaded machine): "
                + ", ".join(f"{t['action']}({t['reason']})" for t in early)
                if early
                else ""
            )
            t0 = time.time()
            await inject(s, ups, t0)
            deadline = t0 + observe_s
            switched_at = None
            while time.time() < deadline:
                await asyncio.sleep(0.25)
                st = await admin_status(s, url)
                watched = next(e for e in st["engines"] if e["name"] == f"omni-{watch_engine}")
                seen = watched["signals"].get(watch)
                if isinstance(seen, (int, float)) and (
                    res.peak_signal is None
                    or (seen < res.peak_signal if watch_low else seen > res.peak_signal)
                ):
                    res.peak_signal = round(seen, 4)
                auto = [t for t in st["recent_transitions"] if t["source"] == "auto" and t["at"] >= t0 - 1]
                if auto and switched_at is None:
                    switched_at = time.time()
                    if until_switch:
                        deadline = min(deadline, switched_at + after_s)
            if switched_at is not None:
                base = await upstream_count(s, ups, watch_engine)
                await asyncio.sleep(2.0)
                later = await upstream_count(s, ups, watch_engine)
                res.after_switch_to_int4 = None if base is None or later is None else later - base
            if after is not None:
                await after(s, ups, url, t0, res)
            t1 = time.time()
            await load.stop()
            runner.cancel()
            st = await admin_status(s, url)
            auto = [t for t in st["recent_transitions"] if t["source"] == "auto" and t["at"] >= t0 - 1]
            routing = [t for t in auto if t["action"] in ROUTING_ACTIONS]
            res.switches = len(routing)
            res.actions = [f"{t['action']}({t['reason']})" for t in auto]
            if routing:
                first = routing[0]
                res.switch_s = round(first["at"] - t0, 2)
                detected = first["detail"].get("detected_at", first["at"])
                res.detect_s = round(detected - t0, 2)
                if isinstance(first["detail"].get("value"), (int, float)):
                    res.trigger_value = round(first["detail"]["value"], 4)
                res.targets = first["detail"].get("targets")
            res.requests, res.failed = load.between(t0, t1)
            if res.failed:
                why = ", ".join(f"{k}: {v}" for k, v in sorted(load.why.items()))
                res.note = f"{res.note}; failures: {why}" if res.note else f"failures: {why}"
            if warm_note:
                res.note = f"{warm_note}; {res.note}" if res.note else warm_note
        finally:
            gw.send_signal(signal.SIGINT)
            try:
                gw.wait(20)
            except Exception:
                gw.kill()
            os.unlink(cfg_path)
            if restart is not None:
                ups.start(restart)
                await wait_http(ups.url(restart) + "/health")
    return res


# -- the incidents --------------------------------------------------------------------------------


async def spike(s, ups, t0):
    await ups.script(s, "int4", first_byte_delay_s=0.9)


async def vram(s, ups, t0):
    await ups.post(s, "int4", "/_metrics", {"kv_cache_usage_perc": 0.95, "num_requests_running": 16})


async def slow_engines(s, ups, t0):
    # Each answer now takes about a second: the engines' caps (4 + 1 + 1) are fewer than the load needs,
    # so requests queue in the gateway and the client's P50 time to first token climbs.
    for v in VARIANTS:
        await ups.script(s, v, first_byte_delay_s=0.2, chunk_delay_s=0.07)


async def sleep_state(s: aiohttp.ClientSession, ups: Upstreams, v: str) -> float | None:
    from engines.rollout.offload import parse_sleep_state

    async with s.get(ups.url(v) + "/metrics") as r:
        return parse_sleep_state(await r.text(), [0, 1, 2])


async def offload_way_back(s, ups, url, t0, res) -> None:
    """BF16 asleep while INT4's memory is short; the pressure ends; time until BF16 is confirmed awake."""
    asleep = await sleep_state(s, ups, "bf16")
    before = await upstream_count(s, ups, "bf16")
    await ups.post(s, "int4", "/_metrics", {"kv_cache_usage_perc": 0.3, "num_requests_running": None})
    cleared = time.time()
    awake_at = None
    while time.time() - cleared < 30:
        await asyncio.sleep(0.25)
        st = await admin_status(s, url)
        done = [t for t in st["recent_transitions"] if t["action"] == "awake" and t["at"] >= cleared]
        if done:
            awake_at = done[0]["at"]
            break
    while_asleep = (await upstream_count(s, ups, "bf16") or 0) - (before or 0)
    woke = "never" if awake_at is None else f"{awake_at - cleared:.2f} s after the pressure ended"
    res.note = (
        f"BF16 sleep level {asleep} while INT4 was short of memory; awake again (its gauge) {woke}; "
        f"BF16 requests while asleep or waking: {while_asleep}"
    )


async def p50_after_raise(s, ups, url, t0, res) -> None:
    st = await admin_status(s, url)
    raised = st.get("raised", {}).get("omni-int4")
    await asyncio.sleep(15.0 if res.switch_s is not None else 0.0)
    st = await admin_status(s, url)
    int4 = next(e for e in st["engines"] if e["name"] == "omni-int4")
    p50 = int4["signals"].get("ttft_p50")
    waiting = sum(e["waiting"] for e in st["engines"])
    res.note = (
        f"INT4 cap 4 -> {raised}; 15 s after: INT4 {int4['in_flight']} in flight (cap {int4['cap']}), "
        f"{waiting} waiting in all, client P50 TTFT over the last 10 s {p50} s"
    )


async def unscored_speech(s, ups, url, t0, res) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with s.get(url + "/metrics") as r:
        text = await r.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("engine") != "omni-int4":
                continue
            if sample.name == "omnigate_sentinel_unscored_total":
                counts["unscored"] = counts.get("unscored", 0.0) + sample.value
            elif (
                sample.name == "omnigate_sentinel_samples_total" and sample.labels.get("outcome") == "scored"
            ):
                counts["scored"] = sample.value
    res.note = (
        f"INT4 answers unscored (not English): {counts.get('unscored', 0):.0f}; scored: "
        f"{counts.get('scored', 0):.0f}, all from the English warm-up"
    )


async def crash(s, ups, t0):
    ups.kill("int4")


def drift_task(ups: Upstreams, start: float, end: float, seconds: float) -> Inject:
    async def inject(s, ups_, t0):
        async def ramp() -> None:
            while True:
                frac = min(1.0, (time.time() - t0) / seconds)
                await ups.script(s, "int4", first_byte_delay_s=start + (end - start) * frac)
                await asyncio.sleep(0.5)

        task = asyncio.create_task(ramp())
        _background.add(task)

    return inject


def noise_task(ups: Upstreams, base: float, jitter: float) -> Inject:
    rng = random.Random(5)

    async def inject(s, ups_, t0):
        async def jitterer() -> None:
            while True:
                await ups.script(s, "int4", first_byte_delay_s=base * rng.uniform(1 - jitter, 1 + jitter))
                await asyncio.sleep(0.05)

        task = asyncio.create_task(jitterer())
        _background.add(task)

    return inject


def zh_task(speech: list) -> Inject:
    async def inject(s, ups, t0):
        _, _, drifted = speech[0]
        # A Chinese transcript with speech the English listener would score as all wrong, were it scored.
        await ups.script(s, "int4", first_byte_delay_s=0.2, text=CHINESE, audio_wav=str(drifted))

    return inject


def wer_task(speech: list) -> Inject:
    async def inject(s, ups, t0):
        said, _, drifted = speech[0]
        await ups.script(s, "int4", first_byte_delay_s=0.2, text=said, audio_wav=str(drifted))

    return inject


_background: set[asyncio.Task] = set()


async def _cancel_background() -> None:
    for t in list(_background):
        t.cancel()
    await asyncio.gather(*_background, return_exceptions=True)
    _background.clear()


async def main_async(args: argparse.Namespace) -> list[Result]:
    ups = Upstreams()
    await ups.start_all()
    await power.start()
    results: list[Result] = []
    only = set(args.only.split(",")) if args.only else None
    tiny = getattr(args, "tiny", False)
    short = dict(warmup_s=4.0, observe_s=12.0, after_s=2.0) if tiny else {}
    if getattr(args, "smoke", False):
        short = dict(warmup_s=2.0, observe_s=5.0, after_s=1.0)
    try:
        plan = [
            ("spike", "latency spike on INT4 (TTFT 0.2 -> 0.9 s)", dict(inject=spike)),
            (
                "vram",
                "VRAM pressure in INT4's metrics (KV cache 95 %)",
                dict(inject=vram, watch="vram_usage"),
            ),
            ("crash", "INT4 engine crash (SIGKILL)", dict(inject=crash, restart="int4")),
            (
                "drift",
                "slow drift on INT4 (TTFT 0.3 -> 0.9 s over 40 s)",
                dict(inject=drift_task(ups, 0.3, 0.9, 40.0), observe_s=60.0),
            ),
            (
                "noise",
                "noise: INT4 TTFT 0.40 s +-20 % for 60 s",
                dict(inject=noise_task(ups, 0.40, 0.2), observe_s=60.0, until_switch=False),
            ),
            (
                "noise-near",
                "noise near the line: INT4 TTFT 0.45 s +-20 % for 60 s",
                dict(inject=noise_task(ups, 0.45, 0.2), observe_s=60.0, until_switch=False),
            ),
            (
                "wer",
                "WER drift: INT4's speech stops matching its transcript",
                dict(inject=None, speech=True, watch="wer"),
            ),
            (
                "energy",
                "energy: BF16 (serving) falls to ~50 tokens/J (GPU 1.2 -> 4 W at ~200 tokens/s)",
                dict(
                    inject=energy_inject,
                    prepare=energy_prepare,
                    tweak=energy_layout,
                    watch="tokens_per_joule",
                    watch_engine="bf16",
                    watch_low=True,
                    observe_s=60.0,
                    note="BF16 serves first here; its last column counts BF16 requests, the signal is the lowest seen",
                ),
            ),
            (
                "accuracy",
                "latency spike on INT4 while INT8 scores 0 % on the held-out set (targets: INT8, then BF16)",
                dict(
                    inject=accuracy_inject,
                    prepare=accuracy_prepare,
                    tweak=accuracy_layout,
                    note="INT8 scored 0 % on the held-out set",
                ),
            ),
            (
                "p50",
                "queueing: answers take 1 s, caps 4+1+1 under 7 req/s (P50 TTFT > 400 ms)",
                dict(
                    inject=slow_engines,
                    watch="ttft_p50",
                    caps={"int4": 4, "int8": 1, "bf16": 1},
                    after=p50_after_raise,
                ),
            ),
            (
                "offload",
                "VRAM pressure on INT4 with an idle BF16 on its GPU, then the way back",
                dict(inject=vram, watch="vram_usage", after=offload_way_back),
            ),
            (
                "wer-zh",
                "Chinese speech on INT4 (the sentinel hears English only)",
                dict(
                    inject=None,
                    speech="zh",
                    watch="wer",
                    until_switch=False,
                    observe_s=30.0,
                    after=unscored_speech,
                ),
            ),
        ]
        speech = None
        for key, title, kw in plan:
            if only and key not in only:
                continue
            rate = args.rate
            kind = kw.pop("speech", False)
            if kind:
                from tests.speech import speech_set

                speech = speech or speech_set(Path(tempfile.mkdtemp(prefix="omnigate-speech-")))
                kw["inject"] = zh_task(speech) if kind == "zh" else wer_task(speech)
                kw["speech"] = speech
                rate = args.speech_rate
            if key == "p50":
                rate = 7.0  # the load: more than caps of 6 serve (5.5/s), less than the raised 10 do (9/s)
            for k, v in short.items():
                kw[k] = min(kw.get(k, v), v) if k in kw else v
            print(f"-- {key}: {title}", file=sys.stderr, flush=True)
            res = await run_scenario(key, title, ups, rate=rate, **kw)
            await _cancel_background()
            results.append(res)
            print(json.dumps(asdict(res)), file=sys.stderr, flush=True)
    finally:
        await _cancel_background()
        await power.stop()
        ups.stop_all()
    return results


def table(results: list[Result]) -> str:
    lines = [
        "| scenario | requests | failed | time to detect | time to switch | switches | signal at the switch "
        "/ peak seen | INT4 requests in the 2 s after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def fmt(x):
            return "—" if x is None else f"{x:.2f} s"

        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.expected}{note} | {r.requests} | {r.failed} | {fmt(r.detect_s)} | {fmt(r.switch_s)} | "
            f"{r.switches} {', '.join(r.actions) if r.actions else ''} | "
            f"{'—' if r.trigger_value is None else r.trigger_value} / "
            f"{'—' if r.peak_signal is None else r.peak_signal} | "
            f"{'—' if r.after_switch_to_int4 is None else r.after_switch_to_int4} |"
        )
    notes = [r for r in results if r.targets is not None or r.note]
    if notes:
        lines.append("")
    for r in notes:
        lines.append(f"- {r.scenario}: {r.note}{'; ' if r.note else ''}first shift's targets {r.targets}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.incidents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (text scenarios)")
    p.add_argument("--speech-rate", type=float, default=4.0, help="requests per second (WER scenario)")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated: spike,vram,crash,drift,noise,noise-near,wer,energy,accuracy,p50,offload,wer-zh",
    )
    add_smoke(p)
    p.add_argument(
        "--tiny", action="store_true", help="short phases, long enough for each incident to play out"
    )
    args = p.parse_args()
    if args.smoke and not args.only:
        args.only = "energy"
    results = asyncio.run(main_async(args))
    print(table(results))
    if args.out or args.smoke:
        doc = smoke_result({"results": [asdict(r) for r in results]}, args)
        emit(doc, out_path(args, "incidents"))


if __name__ == "__main__":
    main()
