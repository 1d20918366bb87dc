"""CPU per streamed chunk of the native aiohttp adapter against the litellm adapter, same upstream.

    python -m bench.adapters [--requests 200] [--chunks 64] [--out FILE] [--smoke]

The adapters run in this process (core 0); the scripted upstream on core 1.
CPU is this process's user+system time divided by the chunks relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    pin_self,
    scripted_upstream,
    smoke_result,
    wait_http,
)
from core.schemas import ChatCompletionRequest
from engines.adapters.settings import EngineConfig
from engines.selection.pool import build_engine


async def _drive(engine, request: ChatCompletionRequest, total: int, concurrency: int) -> tuple[float, int]:
    chunks = 0
    remaining = total

    async def worker() -> None:
        nonlocal chunks, remaining
        while remaining > 0:
            remaining -= 1
            async for d in engine.stream(request):
                if d.text:
                    chunks += 1

    t0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - t0, chunks


async def measure(
    config: EngineConfig, request: ChatCompletionRequest, total: int, concurrency: int, warm_up: int = 10
) -> tuple[float, int]:
    """CPU seconds and text chunks of ``total`` streamed requests through a fresh engine, after a warm-up."""
    engine = build_engine(config)
    await engine.start()
    await _drive(engine, request, warm_up, 2)  # warm-up: imports, pools
    cpu, chunks = await _drive(engine, request, total, concurrency)
    await engine.aclose()
    return cpu, chunks


async def run(args: argparse.Namespace) -> dict:
    pin_self(0)
    port = free_port()
    up = scripted_upstream(port, "vllm", 1, "--chunks", str(args.chunks))
    try:
        await wait_http(f"http://127.0.0.1:{port}/health")
        base = f"http://127.0.0.1:{port}/v1"
        request = ChatCompletionRequest.model_validate(
            {
                "model": "bench",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 1000,
            }
        )
        out = {}
        for kind, model in (("vllm", "scripted"), ("litellm", "hosted_vllm/scripted")):
            config = EngineConfig(
                name=kind, kind=kind, base_url=base, model=model, serves=["bench"], api_key="sk-bench"
            )
            cpu, chunks = await measure(config, request, args.requests, args.concurrency, args.warm_up)
            out[kind] = {
                "requests": args.requests,
                "chunks": chunks,
                "cpu_s": round(cpu, 3),
                "cpu_us_per_chunk": round(cpu / chunks * 1e6, 1),
                "cpu_ms_per_request": round(cpu / args.requests * 1e3, 2),
            }
        out["litellm_over_native"] = round(out["litellm"]["cpu_s"] / max(out["vllm"]["cpu_s"], 1e-3), 1)
        return out
    finally:
        up.terminate()
        up.wait(10)


def cli(doc: str | None, bench: Callable[[argparse.Namespace], Awaitable[dict]], name: str) -> None:
    """The command line both adapter benchmarks take: run ``bench`` and print its result as JSON."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    add_smoke(ap)
    args = ap.parse_args()
    args.warm_up = 10
    if args.smoke:
        args.requests, args.chunks, args.concurrency, args.warm_up = 6, 8, 2, 2
    emit(smoke_result(asyncio.run(bench(args)), args), out_path(args, name))


def main() -> None:
    cli(__doc__, run, "adapters")


if __name__ == "__main__":
    main()
