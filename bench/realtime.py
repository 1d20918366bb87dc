"""Realtime voice sessions through omnigate: added latency to the first audio, CPU per session-minute.

    python -m bench.realtime [--levels 1,8,32] [--seconds 30] [--turns 20] [--out FILE] [--smoke]

omnigate (``omnigate serve``, its default chain: load shedding, request limits, the media policies) runs on
core 0; the scripted vLLM-Omni engine and this client share core 1. Two measurements:

- **Added latency to the first audio.** ``--turns`` times in turn, one answer asked straight of the engine
  (a streamed chat completion carrying the same committed audio) and one through ``/v1/realtime``
  (``input_audio_buffer.commit`` then ``response.create``): the time from the request to the first audio,
  the engine's first audio chunk against the client's first ``response.output_audio.delta``. The
  difference is what the gateway adds: building the turn's chat request, the pre-policies (the media
  limits decode the turn's audio in the sandbox), admission of the turn, engine choice, the relay and the
  resampling into events.
- **CPU per session-minute.** At each of ``--levels``, that many sessions talk at once for ``--seconds``:
  each speaks 2 s of audio in 100 ms pieces at real time, commits, asks for an answer (2 s of speech the
  engine streams at twice real time) and listens to it, over and over. The gateway's CPU seconds (its
  process and its media decoders) over the session-minutes held, and the first-audio p50/p99 of the turns at that level. Sessions per core
  is 60 s over the CPU seconds a session-minute takes (the core's budget, not a measured ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from websockets.asyncio.client import connect

from bench.common import (
    add_smoke,
    emit,
    free_port,
    out_path,
    pct,
    scripted_upstream,
    smoke_result,
    spawn,
    tree_cpu_seconds,
    wait_http,
)

RATE = 24000
MODEL = "bench"
SPEAK_S = 2.0
PIECE_S = 0.1


def _tone(seconds: float) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    return (np.sin(2 * np.pi * 440.0 * t) * 8000).astype("<i2").tobytes()


def _wav_b64(pcm: bytes) -> str:
    from core.audio import wav_header

    return base64.b64encode(wav_header(RATE, 1, len(pcm)) + pcm).decode()


def _config(up_port: int) -> list[str]:
    cfg = {
        "engines": [
            {
                "name": "bench-omni",
                "kind": "vllm-omni",
                "base_url": f"http://127.0.0.1:{up_port}/v1",
                "model": "scripted",
                "variant": "bf16",
                "serves": [MODEL],
                "max_in_flight": 10000,
                "max_in_flight_overloaded": None,
            }
        ],
        "traffic": {"soft_limit": 10000, "hard_limit": 10000},
        # every session comes from this one address, which the cap counts as one key without auth
        "realtime": {"max_sessions_per_key": 10000},
        "auth": {"required": False},
        "logging": {"level": "warning"},
        "audit": {"enabled": True},
    }
    path = Path(tempfile.mkdtemp()) / "omnigate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["-m", "gateway.cli", "serve", "--config", str(path)]


async def _direct_first_audio(session: aiohttp.ClientSession, up: str, pcm: bytes) -> float:
    """Seconds from the request to the engine's first audio chunk, asked straight of the engine."""
    body = {
        "model": "scripted",
        "stream": True,
        "modalities": ["text", "audio"],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": _wav_b64(pcm), "format": "wav"}}],
            }
        ],
    }
    start = time.perf_counter()
    first = None
    async with session.post(up + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if first is None and b'"audio"' in line:
                first = time.perf_counter() - start
    assert first is not None, "the engine sent no audio"
    return first


class Session:
    """One realtime session over a raw WebSocket (the events the benchmark needs, nothing else)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str) -> dict[str, Any]:
        while True:
            event = json.loads(await self.ws.recv())
            if event["type"] == "error":
                raise RuntimeError(f"error event: {event['error']}")
            if event["type"] == kind:
                return event

    async def speak(self, pcm: bytes, pace: bool) -> None:
        step = int(PIECE_S * RATE) * 2
        for at in range(0, len(pcm), step):
            await self.send(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[at : at + step]).decode()}
            )
            if pace:
                await asyncio.sleep(PIECE_S)
        await self.send({"type": "input_audio_buffer.commit"})

    async def answer(self) -> float:
        """Ask for an answer and listen to it whole; seconds from the ask to its first audio."""
        start = time.perf_counter()
        await self.send({"type": "response.create"})
        first = None
        while True:
            event = json.loads(await self.ws.recv())
            kind = event["type"]
            if kind == "error":
                raise RuntimeError(f"error event: {event['error']}")
            if kind == "response.output_audio.delta" and first is None:
                first = time.perf_counter() - start
            if kind == "response.done":
                if event["response"]["status"] != "completed":
                    response = event["response"]
                    raise RuntimeError(f"answer {response['status']}: {response.get('status_details')}")
                assert first is not None, "the answer had no audio"
                return first


async def _open(url: str) -> tuple[Any, Session]:
    ws = await connect(url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}", max_size=None)
    s = Session(ws)
    await s.until("session.created")
    await s.send(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
    )
    await s.until("session.updated")
    return ws, s


async def _latency(url: str, up: str, turns: int) -> dict[str, Any]:
    pcm = _tone(SPEAK_S)
    direct, through = [], []
    ws, s = await _open(url)
    async with aiohttp.ClientSession() as http:
        try:
            for _ in range(turns):
                direct.append(await _direct_first_audio(http, up, pcm))
                await s.speak(pcm, pace=False)
                through.append(await s.answer())
        finally:
            await ws.close()
    added = [t - d for t, d in zip(through, direct, strict=True)]
    return {
        "turns": turns,
        "direct_first_audio_ms": {"p50": pct(direct, 50) * 1e3, "p99": pct(direct, 99) * 1e3},
        "through_first_audio_ms": {"p50": pct(through, 50) * 1e3, "p99": pct(through, 99) * 1e3},
        "added_ms": {"p50": pct(added, 50) * 1e3, "p99": pct(added, 99) * 1e3},
    }


async def _level(url: str, pid: int, sessions: int, seconds: float) -> dict[str, Any]:
    pcm = _tone(SPEAK_S)
    opened = [await _open(url) for _ in range(sessions)]
    firsts: list[float] = []
    deadline = time.monotonic() + seconds

    async def talk(s: Session) -> None:
        while time.monotonic() < deadline:
            await s.speak(pcm, pace=True)
            firsts.append(await s.answer())

    cpu0, t0 = tree_cpu_seconds(pid), time.monotonic()
    try:
        await asyncio.gather(*(talk(s) for _, s in opened))
    finally:
        wall, cpu = time.monotonic() - t0, tree_cpu_seconds(pid) - cpu0
        for ws, _ in opened:
            await ws.close()
    session_minutes = sessions * wall / 60
    per_minute = cpu / session_minutes
    return {
        "sessions": sessions,
        "wall_s": round(wall, 2),
        "turns": len(firsts),
        "cpu_s": round(cpu, 3),
        "cpu_s_per_session_minute": round(per_minute, 4),
        "sessions_per_core": round(60 / per_minute, 1) if per_minute else None,
        "first_audio_ms": {"p50": pct(firsts, 50) * 1e3, "p99": pct(firsts, 99) * 1e3},
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    up_port, gw_port = free_port(), free_port()
    # the engine's answer: a word, then 2 s of speech in ten 0.2 s chunks, 100 ms apart (twice real time)
    upstream = scripted_upstream(
        up_port, "omni", 1, "--text", "Sure.", "--audio-chunks", "10", "--chunk-delay-ms", "100"
    )
    gateway = spawn([*_config(up_port), "--port", str(gw_port)], cpu=0)
    up, url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    try:
        await wait_http(up + "/v1/models")
        await wait_http(url + "/readyz")
        result: dict[str, Any] = {"latency": await _latency(url, up, args.turns), "levels": []}
        for n in args.levels:
            result["levels"].append(await _level(url, gateway.pid, n, args.seconds))
        return result
    finally:
        for p in (gateway, upstream):
            p.terminate()
            p.wait(30)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.realtime", description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--turns", type=int, default=20)
    add_smoke(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.levels, args.seconds, args.turns = [2], 3.0, 2
    result = asyncio.run(_run(args))
    if args.smoke:
        result = smoke_result(result, args)
    emit(result, out_path(args, "realtime"))


if __name__ == "__main__":
    main()
