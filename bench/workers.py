"""``omnigate serve --workers 2`` against one worker: CPU per streamed request, side by side.

    python -m bench.workers [--levels 1,16] [--chunks 64] [--rounds 6] [--requests 240] [--out FILE]
                            [--smoke]

Two gateways run at once, both as a user runs several workers: the default chain, the state that must
be global in Redis (admission, rate limits, engine caps, routing state) and the audit trail in
PostgreSQL (a database of its own each, made for the run and dropped after it), the engine's cap and
admission lifted as bench/compare.py lifts them. ``workers1`` is ``--workers 1``, ``workers2`` is
``--workers 2``. Both gateways are pinned to core 0 (the workers of ``workers2`` share it), the scripted
upstream and this load generator to core 1: the figure compared is CPU per request, summed over the
whole process tree (supervisor, workers, their decoding workers), which one core shows as well as
two; and what each gateway spends idle, per second (probes, leases, heartbeats: once per process). The gateways take turns within each round, so the VM's drift falls on both. Throughput scaling
with the worker count needs a core per worker beyond the upstream's and the load generator's: a
2-core machine cannot show it, and the requests per second here are those of one shared core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import secrets
import subprocess
import tempfile
import uuid
from pathlib import Path

import psutil
import redis
import yaml

from bench.common import (
    LoadResult,
    add_smoke,
    bench_engine,
    cpu_seconds,
    emit,
    free_port,
    out_path,
    pct,
    pin_self,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)
from tests.stores import fresh_pg_database

REDIS = "redis://127.0.0.1:6379/0"
TARGETS = {"workers1": 1, "workers2": 2}


def _config(up_port: int, dsn: str, prefix: str, metrics_port: int) -> dict:
    return {
        "engines": [bench_engine(up_port)],
        "redis": {"url": REDIS},
        "traffic": {"soft_limit": 10000, "hard_limit": 10000, "key_prefix": f"{prefix}:traffic"},
        "rate_limits": {"key_prefix": f"{prefix}:rate"},
        "routing": {"state": {"backend": "redis", "key_prefix": f"{prefix}:routing"}},
        "audit": {"store": "postgres", "postgres_dsn": dsn, "signing": {"key": secrets.token_hex(32)}},
        "metrics": {"host": "127.0.0.1", "port": metrics_port},
        "logging": {"level": "warning"},
    }


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and every process under it."""
    total = cpu_seconds(pid)
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(FileNotFoundError, psutil.NoSuchProcess):
            total += cpu_seconds(child.pid)
    return total


def _merge(into: LoadResult, part: LoadResult) -> None:
    into.ttft += part.ttft
    into.totals += part.totals
    into.requests += part.requests
    into.errors += part.errors
    into.wall += part.wall


async def run(args: argparse.Namespace, dsns: dict[str, str], prefix: str) -> dict:
    pin_self(1)
    up_port = free_port()
    upstream = scripted_upstream(up_port, "vllm", 1, "--chunks", str(args.chunks))
    body = {
        "model": "bench",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4096,
    }
    out: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "chunks_per_request": args.chunks,
        "gateways_on": "core 0 (both workers of workers2 too); upstream and load generator on core 1",
        "targets": {},
    }
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        for target, n in TARGETS.items():
            port, metrics_port = free_port(), 20000 + 100 * n + secrets.randbelow(5000)
            path = Path(tempfile.mkdtemp()) / "omnigate.yaml"
            path.write_text(
                yaml.safe_dump(_config(up_port, dsns[target], f"{prefix}:{target}", metrics_port))
            )
            cli = [
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(path),
                "--port",
                str(port),
                "--workers",
                str(n),
            ]
            procs[target] = spawn(cli, cpu=0, cwd=path.parent)
            await wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180)
            urls[target] = f"http://127.0.0.1:{port}/v1/chat/completions"
            await stream_load(urls[target], body, 4, 40)  # warm-up (every worker takes some)
            out["targets"][target] = {"workers": n, "levels": {}}
        await asyncio.sleep(2)
        idle0 = {t: _tree_cpu(procs[t].pid) for t in TARGETS}
        await asyncio.sleep(args.idle_s)
        for t in TARGETS:  # what the gateway spends serving nothing (probes, leases, heartbeats), per second
            out["targets"][t]["idle_cpu_ms_per_s"] = (_tree_cpu(procs[t].pid) - idle0[t]) / args.idle_s * 1e3
        for c in args.levels:
            per_round = max(c, args.requests // args.rounds)
            loads = {t: LoadResult() for t in TARGETS}
            cpu = dict.fromkeys(TARGETS, 0.0)
            order = list(TARGETS)
            for i in range(args.rounds):
                for target in order[i % 2 :] + order[: i % 2]:
                    cpu0 = _tree_cpu(procs[target].pid)
                    _merge(loads[target], await stream_load(urls[target], body, c, per_round))
                    cpu[target] += _tree_cpu(procs[target].pid) - cpu0
            for target, r in loads.items():
                out["targets"][target]["levels"][c] = {
                    "requests": r.requests,
                    "errors": r.errors,
                    "cpu_ms_per_request": cpu[target] / max(1, r.requests) * 1e3,
                    "requests_per_s": r.requests / r.wall,
                    "ttft_p50_ms": pct(r.ttft, 50) * 1e3,
                    "total_p50_ms": pct(r.totals, 50) * 1e3,
                }
            one, two = (out["targets"][t]["levels"][c]["cpu_ms_per_request"] for t in TARGETS)
            out.setdefault("cpu_per_request_workers2_over_workers1", {})[c] = two / one
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        upstream.terminate()
        upstream.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--requests", type=int, default=240, help="requests per gateway and level, over the rounds"
    )
    ap.add_argument("--idle-s", type=float, default=20.0, help="seconds both gateways sit idle, measured")
    add_smoke(ap)
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    if args.smoke:
        args.levels, args.rounds, args.requests, args.chunks, args.idle_s = [1, 4], 2, 8, 8, 1.0
    prefix = f"omnigate-bench-workers-{uuid.uuid4().hex[:8]}"
    with fresh_pg_database("omnigate_bench") as one, fresh_pg_database("omnigate_bench") as two:
        try:
            result = asyncio.run(run(args, {"workers1": one, "workers2": two}, prefix))
        finally:
            rdb = redis.Redis.from_url(REDIS)
            keys = list(rdb.scan_iter(match=f"*{prefix}*"))
            if keys:
                rdb.delete(*keys)
            rdb.close()
    emit(smoke_result(result, args), out_path(args, "workers"))


if __name__ == "__main__":
    main()
