"""Adapter for speech-to-text servers (kind ``stt``): OpenAI's ``POST /v1/audio/transcriptions``, as vLLM
serves Whisper.

The audio goes as ``multipart/form-data`` (``file``, ``model``, ``language``, ``prompt``,
``temperature``, ``response_format``, ``timestamp_granularities[]``), the audio being what the gateway's
media steps left of the client's upload (16 kHz WAV by default). The engine is asked for ``json`` (the
text) or ``verbose_json`` (its segments, words, language and duration), never for a subtitle format:
the gateway renders ``srt`` and ``vtt`` from the segments itself, so its guards judge the transcript's
words and never a file format. Such an engine serves transcriptions only: a chat request sent to it is
refused with a 400. Its errors are read as every OpenAI-compatible engine's are
(engines/adapters/openai_errors.py); construction, start, close and probes are
engines/adapters/openai_control.py's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import aiohttp
import orjson

from core.errors import EngineProtocolError, EngineRejected, EngineTimeout, EngineUnavailable, OmnigateError
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from core.spooled import SpooledMedia
from engines.adapters.base import declared
from engines.adapters.openai_compat import request_id_header
from engines.adapters.openai_control import OpenAICompatBase
from engines.adapters.openai_errors import status_error
from engines.adapters.settings import EngineConfig

#: what a file of each format the media steps may leave is called, and its type, on the form
_FILES = {
    "wav": ("audio.wav", "audio/wav"),
    "mp3": ("audio.mp3", "audio/mpeg"),
    "flac": ("audio.flac", "audio/flac"),
    "ogg": ("audio.ogg", "audio/ogg"),
    "opus": ("audio.ogg", "audio/ogg"),
    "m4a": ("audio.m4a", "audio/mp4"),
    "mp4": ("audio.mp4", "audio/mp4"),
    "aac": ("audio.aac", "audio/aac"),
    "webm": ("audio.webm", "audio/webm"),
}
# A Whisper server's refusal of the language hint (vLLM: "Unsupported language: xx"), in the gateway's words.
_LANGUAGE = re.compile(r"language", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Transcription:
    """One transcription call: the audio as the media steps left the part, its format, the caller's hints."""

    #: base64 (an ``input_audio`` part's data) or its spool file
    audio: str | SpooledMedia
    format: str
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None
    #: ask for ``verbose_json``: segments (and words, with ``granularities``), language and duration
    detailed: bool = False
    granularities: tuple[str, ...] = ()


@dataclass(slots=True)
class Transcript:
    """What the engine heard: its text and, asked for in detail, its timings; each a JSON value as sent."""

    text: str
    language: str | None = None
    duration: float | None = None
    segments: list[dict[str, Any]] = field(default_factory=list)
    words: list[dict[str, Any]] = field(default_factory=list)


class TranscriptionEngine(OpenAICompatBase):
    """A server of ``/v1/audio/transcriptions`` (kind ``stt``): transcriptions only."""

    extras = ()

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._url = self._base + "/audio/transcriptions"
        # No chat feature is honoured: a chat request setting one is refused by engine choice, the rest here.
        self.capabilities = declared(config, features=frozenset())
        # aiohttp sets the multipart type and boundary itself.
        self._form_headers = {k: v for k, v in self._headers.items() if k != "Content-Type"}

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineUnavailable(f"engine {self.name} is not started", engine=self.name)
        return self._session

    # -- chat: not served ------------------------------------------------
    def _chat_refused(self) -> NoReturn:
        raise EngineRejected(
            f"engine {self.name} serves /v1/audio/transcriptions only; a chat request was routed to it",
            engine=self.name,
            upstream_status=400,
            code="model_not_supported",
            param="model",
            public="this model transcribes audio only: call /v1/audio/transcriptions",
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
        self._chat_refused()
        yield Delta()  # pragma: no cover (an async generator, as the protocol wants)

    async def complete(self, request: ChatCompletionRequest) -> Completion:
        self._chat_refused()

    # -- the call --------------------------------------------------------
    def form(self, call: Transcription) -> aiohttp.FormData:
        """The multipart body: the allow-listed fields, the engine's own model id, the audio as a file."""
        form = aiohttp.FormData()
        filename, content_type = _FILES.get(call.format, ("audio.bin", "application/octet-stream"))
        form.add_field(
            "file", _audio_bytes(call.audio, self.name), filename=filename, content_type=content_type
        )
        form.add_field("model", self.config.model)
        form.add_field("response_format", "verbose_json" if call.detailed else "json")
        if call.language:
            form.add_field("language", call.language)
        if call.prompt:
            form.add_field("prompt", call.prompt)
        if call.temperature is not None:
            form.add_field("temperature", repr(call.temperature))
        for granularity in call.granularities:
            form.add_field("timestamp_granularities[]", granularity)
        return form

    async def transcribe(self, call: Transcription) -> Transcript:
        session = self._require_session()
        form = self.form(call)
        headers = {**self._form_headers, **request_id_header()}
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s + self.config.read_timeout_s):
                async with session.post(self._url, data=form, headers=headers) as resp:
                    if resp.status != 200:
                        raise _worded(await status_error(resp, self.name), self.name)
                    raw = await resp.read()
        except OmnigateError:
            raise
        except TimeoutError as exc:
            raise EngineTimeout(f"engine {self.name} timed out", engine=self.name) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(
                f"engine {self.name} failed: {type(exc).__name__}", engine=self.name
            ) from exc
        return _transcript(raw, self.name)


def _audio_bytes(audio: str | SpooledMedia, engine: str) -> bytes:
    if isinstance(audio, SpooledMedia):
        return audio.read()
    data = audio.partition(",")[2] if audio[:5].lower() == "data:" else audio
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:  # the media steps made it: a bug, not the client's
        raise EngineProtocolError(f"audio for engine {engine} is not base64", engine=engine) from exc


def _worded(error: OmnigateError, engine: str) -> OmnigateError:
    """An engine's refusal of the language hint names ``language``; every other error is chat's."""
    if not (isinstance(error, EngineRejected) and error.status < 500 and error.param is None):
        return error
    if not _LANGUAGE.search(error.detail):
        return error
    return EngineRejected(
        error.detail,
        engine=engine,
        upstream_status=error.status,
        param="language",
        public="the model does not transcribe this language; send another code or leave it out",
    )


def _transcript(raw: bytes, engine: str) -> Transcript:
    """The engine's ``json`` or ``verbose_json`` answer; anything else is a protocol error."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EngineProtocolError(f"engine {engine} sent malformed JSON", engine=engine) from exc
    text = doc.get("text") if isinstance(doc, dict) else None
    if not isinstance(text, str):
        raise EngineProtocolError(f"engine {engine} sent a transcription without text", engine=engine)
    language, duration = doc.get("language"), doc.get("duration")
    segments, words = doc.get("segments") or [], doc.get("words") or []
    if not (isinstance(segments, list) and isinstance(words, list)):
        raise EngineProtocolError(f"engine {engine} sent segments or words that are not lists", engine=engine)
    return Transcript(
        text=text,
        language=language if isinstance(language, str) else None,
        duration=float(duration) if isinstance(duration, (int, float)) else None,
        segments=[_timed(s, ("id", "start", "end", "text"), engine) for s in segments],
        words=[_timed(w, ("word", "start", "end"), engine) for w in words],
    )


def _timed(item: Any, keys: tuple[str, ...], engine: str) -> dict[str, Any]:
    """A segment or word with only the keys the gateway serves, each checked: times are numbers, text text."""
    if not isinstance(item, dict):
        raise EngineProtocolError(f"engine {engine} sent a segment that is not an object", engine=engine)
    out: dict[str, Any] = {}
    for key in keys:
        value = item.get(key)
        ok = isinstance(value, str) if key in ("text", "word") else type(value) in (int, float)
        if not ok:
            raise EngineProtocolError(f"engine {engine} sent a segment without a valid {key}", engine=engine)
        out[key] = value
    return out
