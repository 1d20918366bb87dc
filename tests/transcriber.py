"""A speech-to-text server at the network edge, on OpenAI's wire: ``POST /v1/audio/transcriptions``.

What vLLM serves for a Whisper model, with the model the audio screen runs in the gateway (faster-whisper,
tiny.en, int8 on the CPU) hearing the file it is sent: multipart ``file``, ``model``, ``response_format``
(``json`` answers ``{"text": ...}``, ``text`` the bare words). It keeps what each call brought (its
headers, fields and file) and how many calls it held at once; ``delay_s`` makes it slow.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import soundfile as sf
from aiohttp import web

from policies.media.models import SpeechToText
from tests.harness import free_port


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    fields: dict[str, str]
    filename: str
    file: bytes


@dataclass
class Transcriber:
    delay_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    peak: int = 0
    _now: int = 0
    _stt: SpeechToText | None = None
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Transcriber:
        self._stt = await asyncio.to_thread(SpeechToText, 1)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _transcriptions(self, request: web.Request) -> web.Response:
        self._now += 1
        self.peak = max(self.peak, self._now)
        try:
            return await self._answer(request)
        finally:
            self._now -= 1

    async def _answer(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload: Any = form.get("file")
        if not isinstance(upload, web.FileField) or not form.get("model"):
            return web.json_response({"error": {"message": "file and model are required"}}, status=400)
        data = upload.file.read()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        self.calls.append(Call(request.path_qs, dict(request.headers), fields, upload.filename, data))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
        if rate != 16000 or np.ndim(samples) != 1:
            return web.json_response({"error": {"message": "16 kHz mono only"}}, status=400)
        assert self._stt is not None
        text = await asyncio.to_thread(self._stt.transcribe, samples)
        if fields.get("response_format", "json") == "text":
            return web.Response(text=text)
        return web.json_response({"text": text})
