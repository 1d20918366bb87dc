"""What the engine pool adds to one request: draw the order, claim a slot, report the outcome, release.

    python -m bench.pool_overhead [--requests 200000] [--per-tick 100] [--out FILE] [--smoke]

In-process, no I/O: three engines behind one model (a primary, a 10 % canary and
a fallback), the per-request calls the pipeline makes, timed over many requests.
"""

from __future__ import annotations

import argparse
import time

from prometheus_client import CollectorRegistry

from bench.common import add_smoke, emit, out_path, smoke_result
from engines.adapters.settings import EngineConfig
from engines.rollout.settings import RoutingSettings
from engines.selection.pool import EnginePool, build_engine
from observability.metrics import Metrics


def build() -> EnginePool:
    def cfg(name: str, variant: str, role: str, weight: float | None = None) -> EngineConfig:
        return EngineConfig(name=name, kind="vllm", base_url="http://127.0.0.1:9/v1", model="m", variant=variant,
                            role=role, weight=weight, serves=["omni"])  # fmt: skip

    engines = [
        cfg("int4", "int4", "primary"),
        cfg("next", "int4", "canary", 0.1),
        cfg("bf16", "bf16", "fallback"),
    ]
    pool = EnginePool(
        [build_engine(c) for c in engines], Metrics(CollectorRegistry()), routing=RoutingSettings(seed=1)
    )
    for name in pool.engines:
        pool._healthy[name] = True
    return pool


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pool_overhead", description=__doc__)
    p.add_argument("--requests", type=int, default=200_000)
    p.add_argument("--per-tick", type=int, default=100, help="requests between two window summaries (a tick)")
    add_smoke(p)
    args = p.parse_args()
    if args.smoke:
        args.requests = 1000
    pool = build()
    n, tick_every = args.requests, args.per_tick
    tick_times: list[float] = []
    busy = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        engine = pool.candidates("omni")[0]
        pool.acquire(engine)
        pool.report_success(engine.name, 0.2, None, 1.0)
        pool.release(engine.name)
        busy += time.perf_counter() - t0
        if (i + 1) % tick_every == 0:
            t1 = time.perf_counter()
            pool.summaries(60.0)
            tick_times.append(time.perf_counter() - t1)
    summaries = pool.summaries(60.0)
    tick_times.sort()
    print(f"per request: {busy / n * 1e6:.2f} µs (candidates + acquire + report_success + release)")
    print(
        f"per controller tick, {tick_every} new requests, {n} in the window (off the request path): "
        f"median {tick_times[len(tick_times) // 2] * 1000:.2f} ms, max {tick_times[-1] * 1000:.2f} ms"
    )
    print({k: (v.ok, v.errors) for k, v in summaries.items()})
    if args.out or args.smoke:
        emit(
            smoke_result(
                {
                    "requests": n,
                    "per_request_us": busy / n * 1e6,
                    "ticks": len(tick_times),
                    "tick_median_ms": tick_times[len(tick_times) // 2] * 1000,
                    "tick_max_ms": tick_times[-1] * 1000,
                    "served": {k: v.ok for k, v in summaries.items()},
                },
                args,
            ),
            out_path(args, "pool_overhead"),
        )


if __name__ == "__main__":
    main()
