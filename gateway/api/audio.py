"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/speech``: parse, call the pipeline, render.

Both are plain ASGI routes like chat's (gateway/api/chat.py): authentication, the request's exit stack
(``Pipeline.lifetime``) around the body read and the response, admission before the body. A
transcription's ``multipart/form-data`` body is read a chunk at a time with one size cap (a
``Content-Length`` over it is a 413 before any byte is read), its file spooled as a chat body's
media is (gateway/api/audio_form.py); what the request holds, the spool file included, is given
back however it ends. Each is then served as the chat completion it stands for, or a transcription by the model's
speech-to-text engines (gateway/pipeline/audio.py), and the answer rendered in the endpoint's own shape
(gateway/api/audio_render.py). What is read of the fields and the upload is gateway/api/audio_fields.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any, TypeVar

import orjson
import structlog
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from core.context import RequestContext
from core.errors import (
    ClientClosedRequest,
    InvalidRequest,
    OmnigateError,
    PayloadTooLarge,
    RequestTimeout,
)
from core.schemas import SpeechRequest, TranscriptionRequest
from engines.adapters.stt import Transcript
from gateway.api.audio_fields import (
    AUDIO_PART,
    TEXT_MESSAGE,
    UNSERVED_FIELDS,
    audio_of,
    form_fields,
    format_of,
    granularities_of,
    named_as,
    parse,
)
from gateway.api.audio_form import FILE_FIELD, FormReader, boundary_of
from gateway.api.audio_render import MEDIA_TYPES, encode_speech, transcript_body
from gateway.api.auth import authenticate
from gateway.api.chat import JSONAnswer, _unless_client_leaves
from gateway.auth_failures import TooManyAuthFailures
from gateway.pipeline.audio import (
    Endpoint,
    Hints,
    input_seconds,
    serve_audio,
    serve_transcription,
    speech_chat,
    spoken,
    transcribers,
    transcription_chat,
)
from gateway.pipeline.complete import CompletionResult
from gateway.render import response_headers
from gateway.services import Services
from gateway.tenants import KeyRefused
from observability.trace_spans import RequestTrace

log = structlog.get_logger(__name__)
M = TypeVar("M", bound=BaseModel)

TRANSCRIPTIONS = "/v1/audio/transcriptions"
SPEECH = "/v1/audio/speech"
#: the largest speech request body: its text and instructions at four UTF-8 bytes a character, and room
MAX_SPEECH_BODY = 64 * 1024


class _AudioRoute:
    """The prologue both routes share (a class: Starlette serves a class as ASGI)."""

    #: what the audit record's ``notes.audio.endpoint`` says, whatever ended the request
    endpoint: Endpoint
    #: the route's path (the request span's name)
    path: str

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        services: Services = request.app.state.services
        ctx = RequestContext.new(
            request.scope["state"]["request_id"],
            client_request_id=request.scope["state"].get("client_request_id"),
            requested_priority=request.headers.get(services.settings.traffic.priority_header),
        )
        # Every record of the endpoint says which it is, a request refused before it was served included.
        ctx.outputs.notes["audio"] = {"endpoint": self.endpoint}
        with services.pipeline.traced(ctx, request.headers):
            if isinstance(ctx.trace, RequestTrace) and ctx.trace.sampled:  # named chat's by the tracer
                ctx.trace.span.update_name(f"POST {self.path}")
                ctx.trace.span.set_attributes(
                    {"url.path": self.path, "omnigate.audio.endpoint": self.endpoint}
                )
            try:
                await authenticate(request, ctx)
            except (KeyRefused, TooManyAuthFailures):
                raise  # counted and audited in aggregate (gateway/auth_failures.py), as for chat
            except OmnigateError as exc:
                await services.pipeline.refused(ctx, exc)
                raise
            async with services.pipeline.lifetime(ctx) as stack:
                await services.pipeline.admit(ctx)  # before the body: a refused request costs no read
                response = await self.respond(request, ctx, services, stack)
                await response(scope, receive, send)

    async def respond(
        self, request: Request, ctx: RequestContext, services: Services, stack: contextlib.AsyncExitStack
    ) -> Response:
        raise NotImplementedError


class Transcriptions(_AudioRoute):
    endpoint = "transcriptions"
    path = TRANSCRIPTIONS

    async def respond(
        self, request: Request, ctx: RequestContext, services: Services, stack: contextlib.AsyncExitStack
    ) -> Response:
        server = services.settings.server
        budget = None
        if services.media is not None:
            budget = ctx.media_budget = services.media.request_budget()
        reader = FormReader(boundary_of(request.headers.get("content-type")), budget)
        stack.callback(reader.discard)  # the spool file goes with the request, however it ends
        await _read(request, reader, server.max_body_bytes, server.body_timeout_s)
        ctx.record.body_bytes = reader.size
        upload = reader.result()
        fields = dict(upload.fields)
        granularities = granularities_of(fields)
        form = parse(TranscriptionRequest, form_fields(fields), ctx, services)
        hints = _hints(form, granularities, transcribers(services.pipeline, form.model)[1])
        audio = audio_of(upload)
        chat = transcription_chat(form, audio, format_of(upload))
        del audio
        facts_in = {"input_bytes": upload.size, "input_sha256": upload.sha256}
        upload.file = None  # the chat request holds the audio from here: the pipeline lets go of it

        async def finish(heard: Transcript) -> tuple[Transcript, dict[str, Any]]:
            text = heard.text.strip()
            facts = {
                **facts_in,
                "input_seconds": input_seconds(ctx),
                "response_format": form.response_format,
                "output_chars": len(text),
                "output_sha256": hashlib.sha256(text.encode()).hexdigest(),
            }
            return heard, facts

        serving = serve_transcription(services.pipeline, chat, ctx, hints, finish)
        del chat
        with named_as(AUDIO_PART, FILE_FIELD):
            heard = await _unless_client_leaves(request, serving)
        body, media_type = transcript_body(heard, form.response_format, input_seconds(ctx), form.language)
        return _Answer(body, media_type, response_headers(ctx), server.stream_write_timeout_s)


def _hints(form: TranscriptionRequest, granularities: tuple[str, ...], timed: bool) -> Hints:
    """What the engine is asked for besides the text; timestamps only where speech-to-text engines serve
    the model (``timed``): a chat engine gives none."""
    if form.stream:
        raise InvalidRequest(
            "stream: a transcript is answered whole; send stream=false or leave it out", param="stream"
        )
    if granularities and not timed:
        raise InvalidRequest(
            f"timestamp_granularities[]: {UNSERVED_FIELDS['timestamp_granularities[]']}",
            param="timestamp_granularities[]",
            code="unsupported_field",
        )
    if form.response_format in ("srt", "vtt") and not timed:
        raise InvalidRequest(
            f"response_format {form.response_format} needs timestamps these engines do not give; "
            "use json, text or verbose_json",
            param="response_format",
        )
    if granularities and form.response_format != "verbose_json":
        raise InvalidRequest(
            "timestamp_granularities[] needs response_format verbose_json", param="timestamp_granularities[]"
        )
    detailed = form.response_format in ("verbose_json", "srt", "vtt")
    return Hints(language=form.language, detailed=detailed and timed, granularities=granularities)


class Speech(_AudioRoute):
    endpoint = "speech"
    path = SPEECH

    async def respond(
        self, request: Request, ctx: RequestContext, services: Services, stack: contextlib.AsyncExitStack
    ) -> Response:
        server = services.settings.server
        limit = min(MAX_SPEECH_BODY, server.max_body_bytes)
        raw = await _read_json(request, limit, server.body_timeout_s)
        ctx.record.body_bytes = len(raw)
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc.msg}") from None
        if not isinstance(doc, dict):
            raise InvalidRequest("request body must be a JSON object")
        speech = parse(SpeechRequest, doc, ctx, services)
        if speech.stream_format == "sse":
            raise InvalidRequest(
                "stream_format sse is not served: the answer is the audio file itself (stream_format audio)",
                param="stream_format",
            )
        fmt, speed = speech.response_format, speech.speed

        async def finish(result: CompletionResult) -> tuple[bytes, dict[str, Any]]:
            spoken(result, ctx)
            c = result.completion
            data = await asyncio.to_thread(encode_speech, c.audio, c.sample_rate, c.channels, fmt, speed)
            facts = {
                "input_chars": len(speech.input),
                "response_format": fmt,
                "speed": speed,
                "output_seconds": round(len(c.audio) / (2 * c.channels * c.sample_rate) / speed, 3),
                "output_bytes": len(data),
                "output_sha256": hashlib.sha256(data).hexdigest(),
            }
            return data, facts

        serving = serve_audio(services.pipeline, speech_chat(speech), ctx, "speech", finish)
        with named_as(TEXT_MESSAGE, "input"):
            data = await _unless_client_leaves(request, serving)
        return _Answer(data, MEDIA_TYPES[fmt], response_headers(ctx), server.stream_write_timeout_s)


class _Answer(JSONAnswer):
    """The endpoint's answer, written in pieces within the write deadline as chat's JSON answer is."""

    def __init__(
        self, content: bytes, media_type: str, headers: dict[str, str], write_timeout_s: float
    ) -> None:
        self.media_type = media_type
        super().__init__(content, headers, write_timeout_s)


routes = [
    Route(TRANSCRIPTIONS, Transcriptions(), methods=["POST"], name="audio_transcriptions"),
    Route(SPEECH, Speech(), methods=["POST"], name="audio_speech"),
]


# -- reading ------------------------------------------------------------------------------------------------
async def _read(request: Request, reader: FormReader, limit: int, timeout_s: float) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    try:
        async with asyncio.timeout(timeout_s):  # a client trickling its upload holds a connection: bounded
            async for chunk in request.stream():
                if reader.size + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                reader.feed(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientClosedRequest("the client closed the connection before its request was read") from None


async def _read_json(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                body += chunk
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientClosedRequest("the client closed the connection before its request was read") from None
    return bytes(body)


__all__ = ["SPEECH", "TRANSCRIPTIONS", "routes"]
