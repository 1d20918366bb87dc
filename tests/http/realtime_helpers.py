"""What the realtime tests share: a gateway with a key, the audio they speak, and a raw WebSocket client."""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
from websockets.sync.client import ClientConnection, connect

from tests.conftest import OMNI_MODEL
from tests.speech import synthesize

RATE = 24000


def tone(seconds: float, rate: int = RATE, hz: float = 440.0) -> bytes:
    """A PCM16 tone: a turn for manual commit (VAD is not asked to hear it)."""
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes()


def silence(seconds: float, rate: int = RATE) -> bytes:
    return np.zeros(int(seconds * rate), dtype="<i2").tobytes()


def speech(folder: Path, text: str = "Turn left at the next corner.") -> bytes:
    """Real speech (espeak-ng) as PCM16 at 24 kHz: what server VAD hears as a turn."""
    path = synthesize(text, folder / "said.wav")
    data, rate = sf.read(path, dtype="float32")
    n = int(len(data) * RATE / rate)
    resampled = np.interp(np.linspace(0, len(data) - 1, n), np.arange(len(data)), data)
    return (np.clip(resampled, -1, 1) * 32767).astype("<i2").tobytes()


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


class Client:
    """A raw Realtime client: JSON events out, every server event kept in order."""

    def __init__(self, url: str, key: str | None, model: str = OMNI_MODEL, **kw: Any) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(
            connect(
                url.replace("http://", "ws://") + f"/v1/realtime?model={model}",
                additional_headers=headers,
                open_timeout=10,
                max_size=None,
                **kw,
            )
        )
        self.seen: list[dict[str, Any]] = []

    def send(self, event: dict[str, Any]) -> None:
        self.ws.send(json.dumps(event))

    def append(self, pcm: bytes, piece_s: float = 0.1, pace_s: float = 0.0) -> None:
        step = int(piece_s * RATE) * 2
        for at in range(0, len(pcm), step):
            self.send({"type": "input_audio_buffer.append", "audio": b64(pcm[at : at + step])})
            if pace_s:
                time.sleep(pace_s)

    def until(self, kind: str, timeout: float = 15) -> list[dict[str, Any]]:
        """The events up to and including the next of type ``kind``."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            event = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            self.seen.append(event)
            got.append(event)
            if event["type"] == kind:
                return got

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answer(events: list[dict[str, Any]]) -> tuple[bytes, str, dict[str, Any]]:
    """A response's audio (PCM16), its transcript from the deltas, and its response.done."""
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    words = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    done = next(e for e in events if e["type"] == "response.done")
    return audio, words, done


def audit_rows(db: Path, kind: str | None = None) -> list[dict[str, Any]]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT data FROM audit_log ORDER BY seq").fetchall()
    finally:
        con.close()
    out = [json.loads(r[0]) for r in rows]
    return [r for r in out if kind is None or r["kind"] == kind]
