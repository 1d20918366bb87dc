"""Client cancels mid-answer: how soon does the engine see the abort?

    python -m bench.cancels [--rounds 200] [--out FILE] [--smoke]

The scripted upstream and omnigate run in this process's server thread; a client
opens a request (half streaming, half not), leaves at a random moment, and the
upstream records when its connection was dropped. Prints the abort latency
percentiles per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp
from prometheus_client import CollectorRegistry

from bench.common import add_smoke, emit, out_path, pct, smoke_result
from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from tests.harness import BackgroundLoop, GatewayServer
from tests.upstream import Script, ScriptedUpstream


async def _cancel_one(session: aiohttp.ClientSession, url: str, stream: bool, rng: random.Random) -> float:
    """Start a request, leave at a random point; return the monotonic time the client closed."""
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]}
    if stream:
        resp = await session.post(url, json=body)
        for _ in range(rng.randint(1, 10)):
            await resp.content.readline()
        closed = time.monotonic()
        resp.close()  # drops the connection, as a client that goes away does
        return closed
    # Not streaming: the answer's headers come only at the end, so leave while waiting for them.
    pending = asyncio.ensure_future(session.post(url, json=body))
    await asyncio.sleep(rng.uniform(0.05, 0.5))
    closed = time.monotonic()
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    return closed


async def run_cancels(
    bg: BackgroundLoop, gateway: GatewayServer, up: ScriptedUpstream, rounds: int, seed: int = 7
) -> dict:
    rng = random.Random(seed)
    url = gateway.url + "/v1/chat/completions"
    results: dict[str, list[float]] = {"stream": [], "json": []}
    missing = {"stream": 0, "json": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for i in range(rounds):
            stream = i % 2 == 0
            key = "stream" if stream else "json"
            before = bg.call(lambda: len(up.abort_times))
            closed = await _cancel_one(session, url, stream, rng)
            deadline = time.monotonic() + 5
            while bg.call(lambda: len(up.abort_times)) == before and time.monotonic() < deadline:  # noqa: ASYNC110 - the count lives on the upstream's loop, in another thread
                await asyncio.sleep(0.005)
            times = bg.call(lambda: list(up.abort_times))
            if len(times) == before:
                missing[key] += 1
                continue
            results[key].append(times[-1] - closed)
    return {
        key: {
            "cancels": len(values) + missing[key],
            "aborts_seen": len(values),
            "p50_ms": pct(values, 50) * 1e3 if values else None,
            "p99_ms": pct(values, 99) * 1e3 if values else None,
            "max_ms": max(values) * 1e3 if values else None,
        }
        for key, values in results.items()
    }


def start(bg: BackgroundLoop) -> tuple[GatewayServer, ScriptedUpstream]:
    # 40 chunks, 50 ms apart: every cancel lands while the engine is still answering.
    up = ScriptedUpstream(Script(text=" ".join(["w"] * 40), chunk_delay_s=0.05), record=False)
    bg.run(up.start())
    settings = Settings(
        engines=[EngineConfig(name="e", kind="vllm", base_url=up.base_url, model="scripted", serves=["m"])],
        logging={"level": "warning"},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start(), up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds = 6
    bg = BackgroundLoop()
    gateway, up = start(bg)
    try:
        result = asyncio.run(run_cancels(bg, gateway, up, args.rounds))
        emit(smoke_result(result, args), out_path(args, "cancels"))
    finally:
        gateway.stop()
        bg.run(up.stop())
        bg.close()


if __name__ == "__main__":
    main()
