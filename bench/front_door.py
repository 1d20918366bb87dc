"""The front door's costs: resolving a key, refusing one (with the per-address limit), and one directory refresh.

``python -m bench.front_door --keys 10000 --calls 20000 [--out FILE] [--smoke]``: in-process, no HTTP; the
SQLite
directory in a temporary folder. Figures are wall time per operation (one core, median of
``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.common import add_smoke, emit, out_path, smoke_result
from gateway.auth_failures import AuthFailures, TooManyAuthFailures
from gateway.auth_settings import DirectorySettings, FailureLimitSettings
from gateway.directory.live import LiveDirectory
from gateway.settings import Settings
from gateway.tenants import Directory, KeyEntry, KeyRefused, mint_key
from observability.metrics import Metrics


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


async def _run(keys: int, calls: int, repeat: int) -> dict[str, float]:
    metrics = Metrics(CollectorRegistry())
    with tempfile.TemporaryDirectory() as tmp:
        live = LiveDirectory(DirectorySettings(sqlite_path=Path(tmp) / "d.db"), metrics)
        await live.read()
        await live.store.put_tenant("acme", '{"name": "acme"}', "now")
        minted = [mint_key() for _ in range(keys)]
        await live.store.add_key(
            KeyEntry(minted[0].id, "acme", minted[0].sha256, True, "admin", "now"), "bench"
        )
        rows = [(m.id, "acme", m.sha256, 1, "now", "bench") for m in minted[1:]]

        def bulk() -> None:  # one transaction: the bench measures reads, not 10,000 fsyncs
            db = live.store.db
            db.execute("BEGIN")
            db.executemany("INSERT INTO omnigate_api_keys VALUES (?, ?, ?, ?, ?, ?)", rows)
            db.execute("UPDATE omnigate_directory_revision SET revision = revision + 1")
            db.execute("COMMIT")

        await live.store._run(bulk)
        results: dict[str, list[float]] = {
            "refresh_unchanged": [],
            "refresh_changed": [],
            "authenticate_ok": [],
            "authenticate_refused": [],
            "refused_with_limit": [],
        }
        settings = Settings()
        for _ in range(repeat):
            t = time.perf_counter()
            await live.read()  # the revision moved (or first read): everything is re-read
            results["refresh_changed"].append(time.perf_counter() - t)
            t = time.perf_counter()
            await live.read()  # nothing changed: one row
            results["refresh_unchanged"].append(time.perf_counter() - t)
            live.revision = None  # make the next round re-read everything again
            d = Directory.build(settings, live.tenants, live.keys, live.read_at)
            good = f"Bearer {minted[len(minted) // 2].key}"
            bad = f"Bearer {mint_key().key}"
            results["authenticate_ok"].append(_per_call(lambda d=d, good=good: d.authenticate(good), calls))

            def refuse(d: Directory = d, bad: str = bad) -> None:
                try:  # noqa: SIM105 - timed per call: suppress() would add its own cost to what is measured
                    d.authenticate(bad)
                except KeyRefused:
                    pass

            results["authenticate_refused"].append(_per_call(refuse, calls))
            failures = AuthFailures(
                FailureLimitSettings(max_failures=100_000), metrics, redis=None, key_prefix="b"
            )
            start = time.perf_counter()
            for i in range(calls):
                refuse()
                try:  # noqa: SIM105 - timed, as above
                    await failures.failed(f"10.0.{i % 250}.{i % 7}", "invalid")
                except TooManyAuthFailures:
                    pass
            results["refused_with_limit"].append((time.perf_counter() - start) / calls)
        await live.aclose()
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.keys, args.calls, args.repeat = 50, 200, 1
    out = asyncio.run(_run(args.keys, args.calls, args.repeat))
    print(f"keys in the directory: {args.keys}")
    for name, value in out.items():
        unit, scale = ("ms", 1e3) if name.startswith("refresh") else ("µs", 1e6)
        print(f"{name:24s} {value * scale:10.2f} {unit}")
    if args.out or args.smoke:
        emit(
            smoke_result({"keys": args.keys, "calls": args.calls, "seconds_per_operation": out}, args),
            out_path(args, "front_door"),
        )


if __name__ == "__main__":
    main()
