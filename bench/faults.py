"""Engine faults under load: every stream must end cleanly, with no output twice.

    python -m bench.faults [--rounds 200] [--concurrency 16] [--modes ...] [--out FILE] [--smoke]

Two engines serve one public model: a faulty primary and a healthy fallback. For
each fault mode the client runs ``rounds`` streamed requests, ``concurrency`` at a
time, and checks each stream: it ends with ``data: [DONE]``; an error frame, if
any, comes right before it; the text is the scripted answer, or a prefix of it
when the stream failed after its first byte (never a repeat). It also counts the
upstream attempts per request (failover happens only before the first byte, at
most once per engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from bench.common import add_smoke, emit, out_path, smoke_result
from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from tests.harness import BackgroundLoop, GatewayServer
from tests.upstream import Script, ScriptedUpstream

TEXT = " ".join(f"w{i}" for i in range(16))

#: mode -> the primary's script and whether a failure after the first byte is possible
MODES: dict[str, tuple[Script, bool]] = {
    "500_before_headers": (Script(text=TEXT, fault="500_before_headers"), False),
    "503_retry_after": (Script(text=TEXT, fault="503_retry_after"), False),
    "reset_before_first_byte": (Script(text=TEXT, fault="reset_before_first_byte"), False),
    "hang_before_first_byte": (Script(text=TEXT, fault="hang_before_first_byte"), False),
    "error_after_10_chunks": (Script(text=TEXT, fault="error_mid_stream", fault_after_chunks=10), True),
    "reset_mid_stream": (Script(text=TEXT, fault="reset_mid_stream", fault_after_chunks=10), True),
    "hang_mid_stream": (Script(text=TEXT, fault="hang_mid_stream", fault_after_chunks=10), True),
    "malformed_json": (Script(text=TEXT, fault="malformed_json", fault_after_chunks=10), True),
    "drip_1_chunk_per_s": (Script(text="one two three", fault="drip"), False),
}


def start(
    bg: BackgroundLoop, keepalive_s: float = 5.0
) -> tuple[GatewayServer, ScriptedUpstream, ScriptedUpstream]:
    primary = ScriptedUpstream(Script(text=TEXT), record=False, keepalive_timeout=keepalive_s)
    fallback = ScriptedUpstream(Script(text=TEXT), record=False, keepalive_timeout=keepalive_s)
    bg.run(primary.start())
    bg.run(fallback.start())
    engine = dict(kind="vllm", model="scripted", serves=["m"])
    # The primary's short timeouts keep the hang modes quick; the fallback never hangs, and its longer
    # ones keep a slow host (a loaded CI machine) from turning a healthy answer into a timeout.
    settings = Settings(
        engines=[
            EngineConfig(
                name="primary",
                base_url=primary.base_url,
                first_byte_timeout_s=1.0,
                read_timeout_s=1.5,
                **engine,
            ),
            EngineConfig(
                name="fallback",
                base_url=fallback.base_url,
                role="fallback",
                first_byte_timeout_s=10.0,
                read_timeout_s=10.0,
                **engine,
            ),
        ],
        logging={"level": "error"},
        routing={"controller": {"enabled": False}},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start(), primary, fallback


async def _one(session: aiohttp.ClientSession, url: str, expected: str) -> dict:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    frames: list[bytes] = []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            code = (orjson.loads(await resp.read()).get("error") or {}).get("code")
            return {"status": resp.status, "ok": False, "why": f"status {resp.status} {code}"}
        async for line in resp.content:
            if line.startswith(b"data: "):
                frames.append(line[6:].strip())
    text, errors = "", []
    for i, f in enumerate(frames):
        if f == b"[DONE]":
            continue
        doc = orjson.loads(f)
        if "error" in doc:
            errors.append(i)
            continue
        for c in doc.get("choices") or []:
            text += (c.get("delta") or {}).get("content") or ""
    clean_end = bool(frames) and frames[-1] == b"[DONE]"
    error_placed = not errors or errors == [len(frames) - 2]
    prefix = expected.startswith(text) and (bool(errors) or text == expected)
    return {
        "status": 200,
        "ok": clean_end and error_placed and prefix,
        "errored": bool(errors),
        "why": None if clean_end else "no [DONE]",
    }


async def run_mode(bg, gateway, primary, fallback, mode: str, rounds: int, concurrency: int) -> dict:
    script, _ = MODES[mode]
    expected = script.text

    def _arm() -> None:
        primary.default = script
        fallback.default = Script(text=script.text)
        primary.reset_stats()
        fallback.reset_stats()

    bg.call(_arm)

    async def _heal() -> None:
        await gateway.services.pool.probe_now()
        for name in gateway.services.pool.engines:
            gateway.services.pool.readmit(name)

    bg.run(_heal())
    url = gateway.url + "/v1/chat/completions"
    results: list[dict] = []
    remaining = rounds
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                results.append(await _one(session, url, expected))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    attempts = bg.call(lambda: primary.request_count + fallback.request_count)
    return {
        "requests": len(results),
        "clean": sum(r["ok"] for r in results),
        "ended_with_error_frame": sum(bool(r.get("errored")) for r in results),
        "non_200": sum(r["status"] != 200 for r in results),
        "upstream_attempts": attempts,
        "attempts_per_request": attempts / max(1, len(results)),
        "primary_requests": bg.call(lambda: primary.request_count),
        "wall_s": round(wall, 2),
        "failures": [r for r in results if not r["ok"]][:3],
    }


async def run_keepalive(bg, gateway, primary, fallback, n: int = 16, silence_s: float = 6.0) -> dict:
    """Requests, 6 s of silence (the upstream closes idle connections after 5 s), requests again."""
    # Both engines answer the same: beyond the primary's concurrency cap (8) requests go to the fallback.
    bg.call(
        lambda: [(setattr(u, "default", Script(text=TEXT)), u.reset_stats()) for u in (primary, fallback)]
    )
    url = gateway.url + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        first = await asyncio.gather(*(_one(session, url, TEXT) for _ in range(n)))
        await asyncio.sleep(silence_s)
        second = await asyncio.gather(*(_one(session, url, TEXT) for _ in range(n)))
    results = first + second
    return {"requests": len(results), "clean": sum(r["ok"] and not r.get("errored") for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES))
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.concurrency = 2, 2
    bg = BackgroundLoop()
    # A smoke run's upstreams close idle connections after 1 s instead of 5, so the silence is short too.
    keepalive_s = 1.0 if args.smoke else 5.0
    gateway, primary, fallback = start(bg, keepalive_s)
    out = {}
    try:
        for mode in args.modes.split(","):
            out[mode] = asyncio.run(
                run_mode(bg, gateway, primary, fallback, mode, args.rounds, args.concurrency)
            )
            print(mode, json.dumps(out[mode]), file=sys.stderr, flush=True)
        keepalive = asyncio.run(
            run_keepalive(
                bg, gateway, primary, fallback, n=2 if args.smoke else 16, silence_s=keepalive_s + 1.0
            )
        )
        emit(
            smoke_result({"modes": out, "keepalive_closed_after_5s_idle": keepalive}, args),
            out_path(args, "faults"),
        )
    finally:
        gateway.stop()
        bg.run(primary.stop())
        bg.run(fallback.stop())
        bg.close()


if __name__ == "__main__":
    main()
