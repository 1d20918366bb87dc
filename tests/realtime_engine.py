"""vLLM-Omni's own ``WS /v1/realtime`` for the scripted upstream: turn-based, 16 kHz PCM16 in, the answer's
speech and transcript out, in the new event names (``response.output_audio.*``) or the old
(``response.audio.*``), ``sample_rate_hz`` on each audio event. Like the engine, it answers every committed
turn to its end, whoever stops listening."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson
from aiohttp import WSMsgType, web


@dataclass
class RealtimeEngine:
    """What the socket answers (``names``, ``rate``, ``text``, or ``texts``: one per turn, in turn; ``pace_s``
    between two events of an answer), faults (``die_after_turns``: close the socket at the start of that turn;
    ``silent_after_turns``: that turn's answer stops after its first word, the socket left open), and what it
    saw (events per session, sockets open and closed)."""

    names: Literal["new", "old"] = "new"
    rate: int = 24000
    text: str = "Hello from the engine."
    texts: list[str] | None = None
    pace_s: float = 0.0
    die_after_turns: int | None = None
    silent_after_turns: int | None = None
    sessions: list[list[dict[str, Any]]] = field(default_factory=list)
    opened: int = 0
    closed: int = 0

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        self.opened += 1
        seen: list[dict[str, Any]] = []
        self.sessions.append(seen)
        audio = bytearray()
        turns = 0
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                event = orjson.loads(msg.data)
                seen.append(event)
                if event["type"] == "input_audio_buffer.append":
                    audio += base64.b64decode(event["audio"])
                elif event["type"] == "input_audio_buffer.commit" and event.get("final"):
                    turns += 1
                    if self.die_after_turns is not None and turns > self.die_after_turns:
                        break
                    text = self.texts[turns - 1] if self.texts else self.text
                    silent = self.silent_after_turns is not None and turns > self.silent_after_turns
                    audio.clear()
                    await self._answer(ws, text, silent)
        finally:
            await ws.close()
            self.closed += 1
        return ws

    async def _send(self, ws: web.WebSocketResponse, event: dict[str, Any]) -> None:
        if self.pace_s:
            await asyncio.sleep(self.pace_s)
        await ws.send_str(orjson.dumps(event).decode())

    async def _answer(self, ws: web.WebSocketResponse, text: str, silent: bool) -> None:
        prefix = "response.output_audio" if self.names == "new" else "response.audio"
        for word in text.split(" "):
            await self._send(ws, {"type": "transcription.delta", "delta": word + " "})
            if silent:
                return  # mid-answer, and nothing more: the socket stays open, read as before
        await self._send(ws, {"type": "transcription.done", "text": text})
        t = np.arange(self.rate // 2) / self.rate  # half a second of speech, in two pieces
        pcm = (np.sin(2 * np.pi * 330 * t) * 8000).astype("<i2").tobytes()
        for piece in (pcm[: len(pcm) // 2], pcm[len(pcm) // 2 :]):
            delta = {
                "type": f"{prefix}.delta",
                "delta": base64.b64encode(piece).decode(),
                "sample_rate_hz": self.rate,
            }
            await self._send(ws, delta)
        await self._send(ws, {"type": f"{prefix}.done", "sample_rate_hz": self.rate})
