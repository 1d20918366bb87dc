"""CPU per streamed chunk of the vLLM-Omni adapter against the plain vLLM adapter, same vLLM-Omni upstream.

    python -m bench.omni_adapter [--requests 200] [--chunks 64] [--out FILE] [--smoke]

The vLLM-Omni adapter wraps the shared SSE reading in one more generator (it judges the finish
reason that vLLM-Omni leaves out when speech follows the text); this measures what that costs
per chunk on a text stream both adapters can read. The adapters run in this process (core 0),
the scripted upstream on core 1; CPU is this process's user+system time over the chunks relayed.
"""

from __future__ import annotations

import argparse

from bench.adapters import cli, measure
from bench.common import free_port, pin_self, scripted_upstream, wait_http
from core.schemas import ChatCompletionRequest
from engines.adapters.settings import EngineConfig


async def run(args: argparse.Namespace) -> dict:
    pin_self(0)
    port = free_port()
    up = scripted_upstream(port, "omni", 1, "--chunks", str(args.chunks))
    try:
        await wait_http(f"http://127.0.0.1:{port}/health")
        base = f"http://127.0.0.1:{port}/v1"
        request = ChatCompletionRequest.model_validate(
            {
                "model": "bench",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "max_tokens": 1000,
                "modalities": ["text"],
            }
        )
        out: dict = {}
        for kind in ("vllm", "vllm-omni"):
            config = EngineConfig(name=kind, kind=kind, base_url=base, model="scripted", serves=["bench"])
            cpu, chunks = await measure(config, request, args.requests, args.concurrency, args.warm_up)
            out[kind] = {"requests": args.requests, "chunks": chunks, "cpu_s": round(cpu, 3),
                         "cpu_us_per_chunk": round(cpu / chunks * 1e6, 1)}  # fmt: skip
        out["omni_extra_us_per_chunk"] = round(
            out["vllm-omni"]["cpu_us_per_chunk"] - out["vllm"]["cpu_us_per_chunk"], 1
        )
        return out
    finally:
        up.terminate()
        up.wait(10)


def main() -> None:
    cli(__doc__, run, "omni_adapter")


if __name__ == "__main__":
    main()
