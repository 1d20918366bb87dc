"""A long soak: N concurrent streams against omnigate for a fixed time; does its memory drift?

    python -m bench.soak [--seconds 3600] [--streams 64] [--out FILE] [--smoke]

The scripted upstream paces its chunks (64 chunks, 50 ms apart), so 64 streams
stay open all the time without saturating the 2-core machine. The gateway's RSS
is sampled every 10 s; drift is measured from the end of a warm-up (the first
5 % of the run, at least 2 minutes) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import (
    add_smoke,
    free_port,
    out_path,
    pin_self,
    rss_kib,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)


async def run(args: argparse.Namespace) -> dict:
    pin_self(1)
    up_port, gw_port = free_port(), free_port()
    upstream = scripted_upstream(up_port, "vllm", 1, "--chunks", str(args.chunks), "--chunk-delay-ms", "50")
    cfg = Path(tempfile.mkdtemp()) / "soak.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                # 64 streams really open at once: the per-engine cap (8, 4 under overload) and the admission limits
                # (shed above 16, refuse above 64) would otherwise hold most of them in the engine's wait queue and
                # refuse the rest with 503 engine_busy, which is admission working, not the streaming path soaking.
                "engines": [
                    {
                        "name": "soak",
                        "kind": "vllm",
                        "base_url": f"http://127.0.0.1:{up_port}/v1",
                        "model": "scripted",
                        "serves": ["soak"],
                        "max_in_flight": None,
                        "max_in_flight_overloaded": None,
                    }
                ],
                "traffic": {"soft_limit": 1000, "hard_limit": 1000},
                "logging": {"level": "warning"},
            }
        )
    )
    gateway = spawn(["-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(gw_port)], cpu=0)
    samples: list[tuple[float, int]] = []
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        await wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        body = {
            "model": "soak",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
        }
        t0 = time.monotonic()
        stop = t0 + args.seconds
        totals = {"requests": 0, "errors": 0, "chunks": 0}

        async def load() -> None:
            while time.monotonic() < stop:
                r = await stream_load(url, body, args.streams, args.streams * 4)
                totals["requests"] += r.requests
                totals["errors"] += r.errors
                totals["chunks"] += r.chunks

        async def sample() -> None:
            while time.monotonic() < stop:
                samples.append((time.monotonic() - t0, rss_kib(gateway.pid)))
                await asyncio.sleep(args.sample_every_s)

        await asyncio.gather(load(), sample())
        warm = max(120.0, args.seconds * 0.05)
        after_warm = [kib for t, kib in samples if t >= warm] or [kib for _, kib in samples]
        base, end, peak = after_warm[0], after_warm[-1], max(after_warm)
        return {
            "machine": f"{platform.machine()}, python {platform.python_version()}",
            "seconds": args.seconds,
            "streams": args.streams,
            **totals,
            "rss_mib_after_warmup": round(base / 1024, 1),
            "rss_mib_end": round(end / 1024, 1),
            "rss_mib_peak": round(peak / 1024, 1),
            "drift_pct": round((end - base) / base * 100, 2),
            "samples": [(round(t), kib) for t, kib in samples],
        }
    finally:
        for p in (gateway, upstream):
            p.terminate()
            p.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--streams", type=int, default=64)
    add_smoke(ap)
    args = ap.parse_args()
    args.chunks, args.sample_every_s = 64, 10.0
    if args.smoke:
        args.seconds, args.streams, args.chunks, args.sample_every_s = 3.0, 4, 8, 1.0
    result = smoke_result(asyncio.run(run(args)), args)
    args.out = out_path(args, "soak")
    text = json.dumps(result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
