"""Audit write cost per request, for each store (SQLite, PostgreSQL) and commit mode (sync, group).

    python -m bench.audit [--requests 2000] [--levels 1,32] [--stores sqlite,postgres] [--out FILE] [--smoke]

In-process: ``C`` concurrent simulated requests each hand one realistic record to
the audit log (a 2 KiB prompt, a 1 KiB answer, two policy runs) and wait until it
is durable, as the pipeline does before it acknowledges a response. Reported per
record: the request path's own cost (``submit``), the added time to
acknowledgement (submit to commit: p50, p99), CPU of the whole process (encoder
thread, store thread or driver, event loop), and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import add_smoke, emit, out_path, smoke_result
from core.context import Identity, PolicyRun, Record, RequestContext
from core.events import Completion, Usage
from core.schemas import ChatCompletionRequest
from observability.audit.backends import build_store
from observability.audit.log import AuditLog
from observability.audit.record import RequestSnapshot
from observability.metrics import Metrics
from observability.settings import AuditSettings

PROMPT = ("Summarise the quarterly figures for the board, in three sentences. " * 32)[:2048]
ANSWER = ("Revenue grew, costs held, and the outlook is steady. " * 20)[:1024]


def _snapshot(i: int) -> RequestSnapshot:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "bench",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        }
    )
    ctx = RequestContext(
        Identity(f"bench-{i}", tenant="acme", key_id="abcdefgh1234"),
        Record(
            public_model="bench",
            engine="bench-vllm",
            variant="fp16",
            attempts=1,
            outcome="served",
            stream=True,
            prompt_tokens=512,
            completion_tokens=256,
            ttft_s=0.05,
        ),
    )
    ctx.record.policy_runs = [
        PolicyRun("request-limits", "pre", "accept", 0.02),
        PolicyRun("nsfw", "post", "accept", 3.1),
    ]
    completion = Completion(text=ANSWER, usage=Usage(512, 256))
    return RequestSnapshot(ctx, request, None, completion, 812.5)


async def _one_level(settings: AuditSettings, concurrency: int, total: int) -> dict:
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    submit_s: list[float] = []
    ack_s: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            snap = _snapshot(remaining)
            t0 = time.perf_counter()
            fut = audit.submit(
                "request", request_id=snap.ctx.identity.request_id, tenant="acme", snapshot=snap
            )
            t1 = time.perf_counter()
            await audit.wait(fut)
            t2 = time.perf_counter()
            submit_s.append(t1 - t0)
            ack_s.append(t2 - t0)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await audit.aclose()
    q = statistics.quantiles(ack_s, n=100, method="inclusive")
    return {
        "concurrency": concurrency,
        "records": total,
        "submit_us": statistics.fmean(submit_s) * 1e6,
        "ack_p50_ms": q[49] * 1000,
        "ack_p99_ms": q[98] * 1000,
        "cpu_per_record_us": cpu / total * 1e6,
        "records_per_s": total / wall,
    }


async def run(args: argparse.Namespace) -> list[dict]:
    results = []
    levels = [int(x) for x in args.levels.split(",")]
    for store in args.stores.split(","):
        for mode in ("sync", "group"):
            for c in levels:
                total = args.requests if c > 1 or args.smoke else max(200, args.requests // 4)
                if store == "sqlite":
                    with tempfile.TemporaryDirectory() as tmp:
                        settings = AuditSettings(
                            store="sqlite",
                            sqlite_path=Path(tmp) / "a.db",
                            commit=mode,
                            signing={"key": "bench"},
                        )
                        r = await _one_level(settings, c, total)
                else:
                    from tests.stores import fresh_pg_database_async

                    async with fresh_pg_database_async("omnigate_bench") as dsn:
                        settings = AuditSettings(
                            store="postgres", postgres_dsn=dsn, commit=mode, signing={"key": "bench"}
                        )
                        r = await _one_level(settings, c, total)
                r.update(store=store, mode=mode)
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--levels", default="1,32")
    p.add_argument("--stores", default="sqlite,postgres")
    add_smoke(p)
    args = p.parse_args()
    if args.smoke:
        args.requests, args.levels = 20, "1,4"
    results = asyncio.run(run(args))
    emit(smoke_result({"rows": results}, args), out_path(args, "audit"))
    print(f"\n{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(
        "| store | mode | concurrent | records | submit (request path) | ack p50 / p99 | CPU per record | records/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['store']} | {r['mode']} | {r['concurrency']} | {r['records']} | {r['submit_us']:.1f} µs | "
            f"{r['ack_p50_ms']:.2f} / {r['ack_p99_ms']:.2f} ms | {r['cpu_per_record_us']:.0f} µs | "
            f"{r['records_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
