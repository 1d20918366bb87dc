"""Load shedding under a ramp of concurrent speech requests, and the cost of admission, local and Redis.

    python -m bench.shedding [--store local,redis] [--peak 64] [--over 8] [--ramp-ms 30]
                             [--chunks 40] [--audio-chunks 20] [--chunk-delay-ms 60] [--engine-limit none]
                             [--out FILE] [--smoke]

One scripted vLLM-Omni upstream (core 1) and one gateway (core 0, ``omnigate serve``) with the default
admission levels (soft 16, hard 64) and the ``load-shedding`` policy. Speech requests are started one every
``--ramp-ms`` until ``peak + over`` are open at once; every stream outlives the ramp, so the k-th request
arrives with k others in flight. For each request: status, ``x-omnigate-degraded``, whether audio came back,
time to first token (first text or transcript) and to first audio. Admission cost comes from the gateway's
own histogram and from an in-process loop over the admission gate alone (this process, core 1).
``--smoke`` lowers the levels to soft 2, hard 4 and ramps to 6 short streams, so every zone is reached.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    pct,
    pin_self,
    scripted_upstream,
    smoke_result,
    spawn,
    wait_http,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
BODY = {
    "model": "omni",
    "stream": True,
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Ethan", "format": "wav"},
}


@dataclass
class One:
    index: int
    status: int = 0
    degraded: str = ""
    audio: bool = False
    ttft: float | None = None
    first_audio: float | None = None
    error: str | None = None


#: the default admission levels (soft, hard)
LIMITS = (16, 64)


def _config(
    up_port: int,
    store: str,
    prefix: str,
    engine_limit: int | None,
    workdir: Path,
    limits: tuple[int, int] = LIMITS,
) -> dict:
    traffic: dict = {"soft_limit": limits[0], "hard_limit": limits[1]}
    if store == "redis":
        traffic.update(key_prefix=prefix)
    return {
        **({"redis": {"url": REDIS_URL}} if store == "redis" else {}),
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": f"http://127.0.0.1:{up_port}/v1",
                "model": "scripted",
                "serves": ["omni"],
                "max_in_flight": engine_limit,
                "max_in_flight_overloaded": None if engine_limit is None else max(1, engine_limit // 2),
                "max_wait_s": 120,
                "read_timeout_s": 120,
            }
        ],
        "policies": {"pre": [{"name": "load-shedding"}, {"name": "request-limits"}]},
        "traffic": traffic,
        # The audit trail is on, as in production: each request's record (with its admission decision).
        "audit": {"sqlite_path": str(workdir / "audit.db")},
        "logging": {"level": "warning"},
    }


async def _one(session: aiohttp.ClientSession, url: str, index: int) -> One:
    out = One(index)
    t0 = time.perf_counter()
    try:
        async with session.post(
            url, data=orjson.dumps(BODY), headers={"content-type": "application/json"}
        ) as r:
            out.status = r.status
            out.degraded = r.headers.get("x-omnigate-degraded", "")
            if r.status != 200:
                await r.read()
                return out
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                doc = orjson.loads(line[6:])
                if "error" in doc:
                    out.error = doc["error"].get("code") or "error"
                    continue
                for choice in doc.get("choices") or ():
                    delta = choice.get("delta") or {}
                    audio = delta.get("audio") or {}
                    now = time.perf_counter() - t0
                    if out.ttft is None and (delta.get("content") or audio.get("transcript")):
                        out.ttft = now
                    if audio.get("data"):
                        out.audio = True
                        if out.first_audio is None:
                            out.first_audio = now
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = type(exc).__name__
    return out


def _histogram(metrics_text: str, name: str) -> dict[str, dict]:
    """{store: {"count", "sum", "buckets": [(le, cumulative)]}} from the gateway's /metrics."""
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != name:
            continue
        for s in fam.samples:
            store = s.labels.get("store", "")
            h = out.setdefault(store, {"count": 0.0, "sum": 0.0, "buckets": []})
            if s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
            elif s.name.endswith("_bucket"):
                h["buckets"].append((float(s.labels["le"]), s.value))
    return out


def _counter(metrics_text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == name.removesuffix("_total"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def _bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket holding quantile q (the histogram's resolution)."""
    total = buckets[-1][1] if buckets else 0
    for le, cum in sorted(buckets):
        if total and cum >= q * total:
            return le
    return float("nan")


def _ms(values: list[float], q: float) -> float | None:
    return round(pct(values, q) * 1e3, 2) if values else None


async def _ramp(args: argparse.Namespace, store: str) -> dict:
    up_port, gw_port = free_port(), free_port()
    upstream = scripted_upstream(
        up_port,
        "omni",
        1,
        "--chunks",
        str(args.chunks),
        "--audio-chunks",
        str(args.audio_chunks),
        "--chunk-delay-ms",
        str(args.chunk_delay_ms),
    )
    prefix = f"omnigate-bench:{uuid.uuid4().hex}"
    workdir = Path(tempfile.mkdtemp())
    cfg = workdir / "shedding.yaml"
    cfg.write_text(yaml.safe_dump(_config(up_port, store, prefix, args.engine_limit, workdir, args.limits)))
    gateway = spawn(["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(gw_port)], cpu=0)
    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        await wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
        ) as session:
            for _ in range(3):  # warm the connection pools and first-call paths
                await _one(session, url, -1)
            async with session.get(f"http://127.0.0.1:{gw_port}/metrics") as r:
                text = await r.text()
                before = _histogram(text, "omnigate_admission_duration_seconds")
                wait_before = _histogram(text, "omnigate_engine_queue_wait_seconds")
                adm_before = _counter(text, "omnigate_admission_total", "result")
                shed_before = _counter(text, "omnigate_admission_shed_total", "reason")
            tasks = []
            t0 = time.perf_counter()
            for i in range(args.peak + args.over):
                tasks.append(asyncio.create_task(_one(session, url, i)))
                await asyncio.sleep(max(0.0, t0 + (i + 1) * args.ramp_ms / 1000 - time.perf_counter()))
            results: list[One] = await asyncio.gather(*tasks)
            async with session.get(f"http://127.0.0.1:{gw_port}/metrics") as r:
                text = await r.text()
                after = _histogram(text, "omnigate_admission_duration_seconds")
                wait_after = _histogram(text, "omnigate_engine_queue_wait_seconds")
                adm_after = _counter(text, "omnigate_admission_total", "result")
                shed_after = _counter(text, "omnigate_admission_shed_total", "reason")
    finally:
        for p in (gateway, upstream):
            p.terminate()
            try:
                p.wait(10)
            except Exception:
                p.kill()
        if store == "redis":
            import redis

            r = redis.Redis.from_url(REDIS_URL)
            r.delete(f"{{{prefix}}}:slots")
            r.close()

    soft, hard = args.limits
    below = [o for o in results if o.index < soft]
    shed_zone = [o for o in results if soft <= o.index < hard]
    over = [o for o in results if o.index >= hard]
    admitted = [o for o in results if o.status == 200]
    h = after.get(store, {"count": 0, "sum": 0, "buckets": []})
    h0 = before.get(store, {"count": 0, "sum": 0, "buckets": []})
    n = h["count"] - h0["count"]
    buckets0 = dict(h0["buckets"])
    diff = [(le, cum - buckets0.get(le, 0)) for le, cum in h["buckets"]]
    w1 = wait_after.get("", {"count": 0, "sum": 0})
    w0 = wait_before.get("", {"count": 0, "sum": 0})
    waits = w1["count"] - w0["count"]
    return {
        "store": store,
        "requests": len(results),
        "gateway_counts": {k: v - adm_before.get(k, 0.0) for k, v in sorted(adm_after.items())},
        "gateway_shed": {k: v - shed_before.get(k, 0.0) for k, v in sorted(shed_after.items())},
        "client_counts": {
            "ok_with_speech": sum(1 for o in results if o.status == 200 and o.audio and not o.degraded),
            "ok_text_only": sum(
                1 for o in results if o.status == 200 and o.degraded == "load-text-only" and not o.audio
            ),
            "refused_503": sum(1 for o in results if o.status == 503),
            "errors_mid_stream": sum(1 for o in results if o.error),
        },
        "below_soft": {
            "requests": len(below),
            "served_with_speech": sum(1 for o in below if o.status == 200 and o.audio and not o.degraded),
            "errors": sum(1 for o in below if o.status != 200 or o.error),
        },
        "soft_to_hard": {
            "requests": len(shed_zone),
            "text_only": sum(
                1 for o in shed_zone if o.status == 200 and o.degraded == "load-text-only" and not o.audio
            ),
            "errors": sum(1 for o in shed_zone if o.status != 200 or o.error),
        },
        "above_hard": {
            "requests": len(over),
            "refused_503": sum(1 for o in over if o.status == 503),
            "other": sum(1 for o in over if o.status not in (503,)),
        },
        "ttft_ms": {
            "speech_p50": _ms([o.ttft for o in below if o.ttft is not None], 50),
            "speech_p99": _ms([o.ttft for o in below if o.ttft is not None], 99),
            "text_only_p50": _ms([o.ttft for o in shed_zone if o.ttft is not None], 50),
            "text_only_p99": _ms([o.ttft for o in shed_zone if o.ttft is not None], 99),
            "all_admitted_p50": _ms([o.ttft for o in admitted if o.ttft is not None], 50),
            "all_admitted_p99": _ms([o.ttft for o in admitted if o.ttft is not None], 99),
        },
        "first_audio_ms": {
            "p50": _ms([o.first_audio for o in below if o.first_audio is not None], 50),
            "p99": _ms([o.first_audio for o in below if o.first_audio is not None], 99),
        },
        "engine_queue_wait_mean_ms": round((w1["sum"] - w0["sum"]) / waits * 1e3, 2) if waits else None,
        "gateway_admission": {
            "samples": n,
            "mean_us": round((h["sum"] - h0["sum"]) / n * 1e6, 1) if n else None,
            "p50_le_us": _bucket_quantile(diff, 0.5) * 1e6 if n else None,
            "p99_le_us": _bucket_quantile(diff, 0.99) * 1e6 if n else None,
        },
    }


async def _admission_loop(store: str, n: int, concurrency: int) -> dict:
    """The gate alone in this process: admit + release, sequentially and ``concurrency`` at a time."""
    from core.context import RequestContext
    from gateway.admission import AdmissionGate
    from gateway.redis_client import SharedRedis
    from gateway.traffic_settings import RedisSettings, TrafficSettings
    from observability.metrics import Metrics

    prefix = f"omnigate-bench:{uuid.uuid4().hex}"
    cfg = TrafficSettings(hard_limit=100000, soft_limit=100000, key_prefix=prefix)
    redis = SharedRedis(RedisSettings(url=REDIS_URL if store == "redis" else None))
    gate = AdmissionGate(cfg, Metrics(CollectorRegistry()), redis=redis)
    await gate.start()
    try:
        for _ in range(200):  # warm-up
            (await gate.admit(RequestContext.new("w"))).release()
        seq: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            ticket = await gate.admit(RequestContext.new("r"))
            seq.append(time.perf_counter() - t0)
            ticket.release()
        conc: list[float] = []

        async def worker(k: int) -> None:
            for _ in range(k):
                t0 = time.perf_counter()
                ticket = await gate.admit(RequestContext.new("r"))
                conc.append(time.perf_counter() - t0)
                await asyncio.sleep(0)
                ticket.release()

        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
        if store == "redis":
            await asyncio.gather(*gate.store._tasks)
    finally:
        await gate.aclose()
        await redis.aclose()
    return {
        "store": store,
        "sequential_us": {
            "p50": round(pct(seq, 50) * 1e6, 1),
            "p99": round(pct(seq, 99) * 1e6, 1),
            "mean": round(statistics.fmean(seq) * 1e6, 1),
        },
        f"concurrent_{concurrency}_us": {
            "p50": round(pct(conc, 50) * 1e6, 1),
            "p99": round(pct(conc, 99) * 1e6, 1),
        },
    }


async def run(args: argparse.Namespace) -> dict:
    pin_self(1)
    ramps = [await _ramp(args, store) for store in args.store]
    loops = [await _admission_loop(store, args.loop_requests, 64) for store in args.store]
    return {
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "ramp": {
            "peak": args.peak,
            "over": args.over,
            "interval_ms": args.ramp_ms,
            "stream_s": (args.chunks + args.audio_chunks) * args.chunk_delay_ms / 1000,
            "engine_limit": args.engine_limit,
        },
        "ramps": ramps,
        "admission_in_process": loops,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="local,redis", type=lambda s: s.split(","))
    ap.add_argument("--peak", type=int, default=64)
    ap.add_argument("--over", type=int, default=8, help="requests past the hard limit")
    ap.add_argument("--ramp-ms", type=float, default=30.0)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--audio-chunks", type=int, default=20)
    ap.add_argument("--chunk-delay-ms", type=float, default=60.0)
    ap.add_argument(
        "--engine-limit",
        type=lambda s: None if s == "none" else int(s),
        default=None,
        help="the engine's max_in_flight (its overload limit is half); none: no per-engine limit",
    )
    ap.add_argument("--loop-requests", type=int, default=5000)
    add_smoke(ap)
    args = ap.parse_args()
    args.limits = LIMITS
    if args.smoke:
        args.limits, args.peak, args.over, args.chunks, args.audio_chunks = (2, 4), 4, 2, 6, 4
        args.chunk_delay_ms, args.loop_requests = 20.0, 200
    emit(smoke_result(asyncio.run(run(args)), args), out_path(args, "shedding"))


if __name__ == "__main__":
    main()
