"""The gateway's added time to first token and CPU per relayed chunk, against the scripted upstream.

    python -m bench.overhead [--levels 1,16,64] [--chunks 64] [--chunk-delay-ms 2] [--out FILE] [--smoke]

The gateway runs on core 0; the upstream and this load generator on core 1.
Each level runs the same load against the upstream directly and through
omnigate; the difference in TTFT is what the gateway adds.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import (
    add_smoke,
    cpu_seconds,
    emit,
    free_port,
    out_path,
    pct,
    pin_self,
    rss_kib,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)


def _config(upstream_port: int, chain: str) -> dict:
    pre = [] if chain == "off" else [{"name": "request-limits"}]
    return {
        "engines": [
            {
                "name": "bench-vllm",
                "kind": "vllm",
                "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                "model": "scripted",
                "variant": "fp16",
                "serves": ["bench"],
                # No engine concurrency cap: what is measured is the gateway's own cost, not the wait for a slot
                # that the default cap (8 at once, 4 under overload) makes at 16 and 64 streams.
                "max_in_flight": None,
                "max_in_flight_overloaded": None,
            }
        ],
        "policies": {"pre": pre},
        "logging": {"level": "warning"},
    }


async def run(args: argparse.Namespace) -> dict:
    pin_self(1)
    up_port, gw_port = free_port(), free_port()
    upstream = scripted_upstream(
        up_port, "vllm", 1, "--chunks", str(args.chunks), "--chunk-delay-ms", str(args.chunk_delay_ms)
    )
    cfg = Path(tempfile.mkdtemp()) / "bench.yaml"
    cfg.write_text(yaml.safe_dump(_config(up_port, args.chain)))
    gateway = spawn(["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(gw_port)], cpu=0)
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        await wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        idle_rss = rss_kib(gateway.pid)
        body = {
            "model": "bench",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1000,
        }
        direct_body = {**body, "model": "scripted"}
        # warm both paths (connection pools, first-call imports)
        await stream_load(f"http://127.0.0.1:{up_port}/v1/chat/completions", direct_body, 4, 20)
        await stream_load(f"http://127.0.0.1:{gw_port}/v1/chat/completions", body, 4, 20)
        levels = []
        for c in args.levels:
            total = max(args.min_requests, c * args.rounds)
            direct = await stream_load(
                f"http://127.0.0.1:{up_port}/v1/chat/completions", direct_body, c, total
            )
            cpu0 = cpu_seconds(gateway.pid)
            t0 = time.perf_counter()
            via = await stream_load(f"http://127.0.0.1:{gw_port}/v1/chat/completions", body, c, total)
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(gateway.pid) - cpu0
            levels.append(
                {
                    "concurrency": c,
                    "requests": via.requests,
                    "errors": direct.errors + via.errors,
                    "direct_ttft_ms": {"p50": pct(direct.ttft, 50) * 1e3, "p99": pct(direct.ttft, 99) * 1e3},
                    "gateway_ttft_ms": {"p50": pct(via.ttft, 50) * 1e3, "p99": pct(via.ttft, 99) * 1e3},
                    "added_ttft_ms": {
                        "p50": (pct(via.ttft, 50) - pct(direct.ttft, 50)) * 1e3,
                        "p99": (pct(via.ttft, 99) - pct(direct.ttft, 99)) * 1e3,
                    },
                    "added_gap_ms_p50": (pct(via.gaps, 50) - pct(direct.gaps, 50)) * 1e3,
                    "gateway_cpu_s": cpu,
                    "cpu_us_per_chunk": cpu / max(1, via.chunks) * 1e6,
                    "cpu_ms_per_request": cpu / max(1, via.requests) * 1e3,
                    "requests_per_s": via.requests / wall,
                    "rss_kib_after": rss_kib(gateway.pid),
                }
            )
        return {
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
            "chunks_per_request": args.chunks,
            "chunk_delay_ms": args.chunk_delay_ms,
            "policy_chain": args.chain,
            "idle_rss_kib": idle_rss,
            "levels": levels,
        }
    finally:
        for p in (gateway, upstream):
            p.terminate()
            try:
                p.wait(10)
            except Exception:
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,16,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-delay-ms", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4, help="requests per worker at each level")
    ap.add_argument("--min-requests", type=int, default=100)
    ap.add_argument("--chain", choices=["off", "default"], default="default")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.levels, args.chunks, args.min_requests, args.rounds = [1, 4], 8, 8, 2
    emit(smoke_result(asyncio.run(run(args)), args), out_path(args, "overhead"))


if __name__ == "__main__":
    main()
