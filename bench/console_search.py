"""What the console's audit reads cost on a long chain: search pages, one filter each, a range verify, an export.

    python -m bench.console_search [--records 50000] [--stores sqlite,postgres] [--repeat 15]
                                   [--out FILE] [--smoke]

Fills a fresh store with ``--records`` request records (ten tenants, four engines;
1 % refused, 0.2 % degraded to text-only, 0.5 % with a policy that rejected), then
times each query the admin API makes for the console, newest first, 50 a page:
the median and the slowest of ``--repeat`` runs. PostgreSQL needs the test
server on 127.0.0.1:5432 (``scripts/test-env.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import add_smoke, emit, out_path, smoke_result
from observability.audit.chain import Signer, canonical
from observability.audit.search import AuditQuery
from observability.audit.store import AuditStore, Entry
from observability.audit.verify import export_store
from observability.audit.verify_range import verify_range

PAGE = 50
BATCH = 1000


def _entry(i: int) -> Entry:
    ts = f"2026-03-{1 + i // 86400 % 28:02d}T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}.{i % 10**6:06d}Z"
    refused = i % 100 == 7
    payload = {
        "outcome": "refused" if refused else ("degraded" if i % 500 == 3 else "served"),
        "engine": None if refused else f"engine-{i % 4}",
        "status": 400 if refused else 200,
        "degraded": ["load-text-only"] if i % 500 == 3 else [],
        "policies": [
            {"name": "request-limits", "verdict": "rewrite", "duration_ms": 0.03},
            {"name": "nsfw-screen", "verdict": "reject" if i % 200 == 11 else "accept", "duration_ms": 4.1},
        ],
        "input": [{"role": "user", "type": "text", "sha256": "0" * 64, "chars": 2048}],
    }
    tenant = f"tenant-{i % 10}"
    rid = f"req-{i:08d}"
    data = canonical({"ts": ts, "kind": "request", "request_id": rid, "tenant": tenant, "payload": payload})
    return Entry(ts, "request", rid, tenant, data)


QUERIES: dict[str, AuditQuery] = {
    "newest page, no filter": AuditQuery(),
    "tenant (1 in 10)": AuditQuery(tenant="tenant-3"),
    "request id (indexed)": AuditQuery(request_id="req-00012345"),
    "outcome refused (1 %)": AuditQuery(outcome="refused"),
    "policy + verdict (0.5 %)": AuditQuery(policy="nsfw-screen", verdict="reject"),
    "degraded text-only (0.2 %)": AuditQuery(degraded="load-text-only"),
    "time range, one hour": AuditQuery(
        since="2026-03-01T05:00:00.000000Z", until="2026-03-01T06:00:00.000000Z"
    ),
    "no match (whole chain)": AuditQuery(engine="engine-9"),
}


async def _fill(store: AuditStore, n: int) -> float:
    t0 = time.perf_counter()
    for start in range(0, n, BATCH):
        await store.append_encoded(lambda s=start: [_entry(i) for i in range(s, min(n, s + BATCH))])
    return time.perf_counter() - t0


async def _time(fn, repeat: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        runs.append((time.perf_counter() - t0) * 1000)
    return statistics.median(runs), max(runs)


async def bench_store(store: AuditStore, n: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per figure: its median and slowest run in ms (the fill and the export run once)."""
    await store.open()
    try:
        fill_s = await _fill(store, n)
        out = {"fill": {"records": n, "seconds": fill_s}}
        for name, q in QUERIES.items():
            med, worst = await _time(lambda q=q: store.search(q, PAGE + 1), repeat)
            out[name] = {"median_ms": med, "slowest_ms": worst}
        signer = Signer("none", "bench", None)
        span = min(1000, n // 2)
        med, worst = await _time(lambda: verify_range(store, signer, n // 2, n // 2 + span - 1), repeat)
        out[f"verify {span:,} records mid-chain"] = {"median_ms": med, "slowest_ms": worst}
        t0 = time.perf_counter()
        await export_store(store, io.BytesIO())
        out[f"export all {n} (JSON lines)"] = {"ms": (time.perf_counter() - t0) * 1000}
        return out
    finally:
        await store.close()


async def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.console_search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--stores", default="sqlite,postgres")
    ap.add_argument("--repeat", type=int, default=15)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.records, args.repeat = 400, 2
    stores = {}
    for name in args.stores.split(","):
        if name == "sqlite":
            from observability.audit.sqlite import SQLiteStore

            with tempfile.TemporaryDirectory() as tmp:
                rows = await bench_store(SQLiteStore(Path(tmp) / "audit.db"), args.records, args.repeat)
        else:
            from observability.audit.postgres import PostgresStore
            from tests.stores import fresh_pg_database_async

            async with fresh_pg_database_async("omnigate_bench") as dsn:
                rows = await bench_store(PostgresStore(dsn), args.records, args.repeat)
        stores[name] = rows
        print(f"\n{name}: query | median / slowest of {args.repeat}")
        for label, value in rows.items():
            if "median_ms" in value:
                print(f"  {label:34s} {value['median_ms']:.2f} / {value['slowest_ms']:.2f} ms")
            elif label == "fill":
                print(f"  {label:34s} {value['records']} records in {value['seconds']:.1f} s")
            else:
                print(f"  {label:34s} {value['ms']:.0f} ms")
    if args.out or args.smoke:
        emit(
            smoke_result({"records": args.records, "repeat": args.repeat, "stores": stores}, args),
            out_path(args, "console_search"),
        )


if __name__ == "__main__":
    asyncio.run(main())
