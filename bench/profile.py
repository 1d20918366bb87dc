"""Where the gateway's CPU goes: py-spy samples of omnigate under streamed load, grouped by layer.

    python -m bench.profile [--streams 64] [--seconds 20] [--chain default|off] [--out FILE] [--smoke]

omnigate runs alone on core 0 with the same configuration as ``bench.compare``
(admission limits lifted; ``default`` is the chain a config without ``policies`` gets,
the SQLite audit trail on); the scripted upstream (64 chunks, no delay) and the
load generator share core 1. py-spy (``pip install py-spy``) records the gateway
for ``--seconds`` while ``--streams`` streams run back to back, sampling only the
thread that holds the GIL (``--gil``), so time a thread spends waiting (an idle
worker, an fsync) is not counted. Every sample is charged to the innermost frame
that belongs to a known layer: a sample inside aiohttp's reader called from the
engine adapter counts as "engine client", one in a C call of the loop with no
Python frame of a known layer as "event loop". Without py-spy, ``--smoke`` still runs the
gateway under the load and says that the samples were not taken.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    pin_self,
    scripted_upstream,
    smoke_result,
    spawn,
    stream_load,
    wait_http,
)
from bench.compare import _omnigate

# (layer, substrings of a frame's "function (file:line)"), first match from the innermost frame wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("audit (writer task, SQLite thread)", ("observability/audit/",)),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("logging (structlog)", ("structlog/",)),
    (
        "engine client (aiohttp, SSE parsing)",
        (
            "aiohttp/",
            "engines/adapters/openai_compat.py",
            "engines/adapters/openai_sse.py",
            "engines/adapters/openai_read.py",
            "engines/adapters/vllm_omni.py",
        ),
    ),
    ("HTTP server (uvicorn, httptools)", ("uvicorn/", "httptools")),
    ("framework (Starlette, FastAPI middleware)", ("starlette/", "fastapi/", "gateway/middleware.py")),
    ("SSE response and rendering", ("gateway/sse.py", "gateway/render.py", "gateway/api/chat.py")),
    ("pipeline and policies", ("gateway/pipeline/", "policies/", "gateway/admission.py", "core/context.py")),
    (
        "engine pool and routing",
        (
            "engines/selection/pool.py",
            "engines/selection/slots.py",
            "engines/selection/health.py",
            "engines/selection/choice.py",
            "engines/rollout/routing.py",
            "engines/selection/circuit.py",
            "engines/rollout/signals.py",
            "engines/controller.py",
        ),
    ),
    ("request parsing (pydantic, orjson)", ("pydantic", "core/schemas.py", "core/message.py")),
    ("asyncio (Python parts)", ("asyncio/",)),
]


def layer_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for layer, marks in LAYERS:
            if any(m in frame for m in marks):
                return layer
    return "event loop and other (uvloop, thread plumbing)" if frames else "other"


def summarise(raw: Path) -> dict:
    layers: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        layers[layer_of(frames)] += n
        functions[frames[-1]] += n
    return {
        "samples": total,
        "layers_pct": {k: round(100 * v / total, 1) for k, v in layers.most_common()},
        "top_functions_pct": {k: round(100 * v / total, 1) for k, v in functions.most_common(15)},
    }


async def _load_until(url: str, body: dict, streams: int, done) -> int:
    """``streams`` streams back to back until ``done()``; the requests served."""
    served = 0
    while not done():
        served += (await stream_load(url, body, streams, streams)).requests
    return served


async def run(args: argparse.Namespace) -> dict:
    spy = shutil.which("py-spy")
    if spy is None and not args.smoke:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    pin_self(1)
    up_port, port = free_port(), free_port()
    upstream = scripted_upstream(up_port, "vllm", 1, "--chunks", "64")
    gateway = None
    try:
        await wait_http(f"http://127.0.0.1:{up_port}/health")
        gateway = spawn(_omnigate(up_port, port, args.chain), cpu=0)
        await wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {
            "model": "bench",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4096,
        }
        await stream_load(url, body, 4, 40)  # warm-up
        if spy is None:  # a smoke run without py-spy: the gateway under the load, no samples
            loop = asyncio.get_running_loop()
            until = loop.time() + args.seconds
            served = await _load_until(url, body, args.streams, lambda: loop.time() >= until)
            out: dict = {"requests": served}
        else:
            raw = Path(args.raw) if args.raw else Path(tempfile.mkdtemp()) / "py-spy.txt"
            recorder = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(gateway.pid),
                    "--duration",
                    str(args.seconds),
                    "--rate",
                    "250",
                    "--gil",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            load = asyncio.create_task(stream_load(url, body, args.streams, 10**9))
            while recorder.poll() is None:  # noqa: ASYNC110 - py-spy is a child process, not something to await
                await asyncio.sleep(0.2)
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            if not raw.exists():
                raise SystemExit("py-spy wrote nothing (ptrace may be forbidden here)")
            out = summarise(raw)
        out.update(
            {
                "machine": f"{platform.machine()}, python {platform.python_version()}",
                "streams": args.streams,
                "seconds": args.seconds,
                "chain": args.chain,
            }
        )
        return out
    finally:
        for proc in (gateway, upstream):
            if proc is not None:
                proc.terminate()
                proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--chain", choices=["default", "off"], default="default")
    ap.add_argument("--raw", help="keep py-spy's raw samples (collapsed stacks) in this file")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.streams, args.seconds = 4, 2
    missing = {}
    if shutil.which("py-spy") is None:
        missing["py-spy samples"] = "py-spy is not installed (pip install py-spy)"
    emit(smoke_result(asyncio.run(run(args)), args, missing), out_path(args, "profile"))


if __name__ == "__main__":
    main()
