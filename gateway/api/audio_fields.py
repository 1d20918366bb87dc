"""What the audio routes read of a request before serving it: the fields (unknown ones refused or dropped,
those OpenAI defines that these engines cannot honour refused by name), the upload as ``input_audio``
takes it and the format it declares; and the name an error about the chat request's part gives the client.

Split from :mod:`gateway.api.audio`, which only reads, calls the pipeline and renders.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from core.context import RequestContext
from core.errors import InvalidRequest, OmnigateError, UnknownField
from core.spooled import SpooledMedia
from gateway.api.audio_form import FILE_FIELD, Upload
from gateway.api.validation import validation_to_error
from gateway.fields import DROPPED_HEADER, dropped_header
from gateway.services import Services

log = structlog.get_logger(__name__)
M = TypeVar("M", bound=BaseModel)

#: OpenAI form fields this gateway cannot honour, and why (a 400 naming the field, never ignored)
UNSERVED_FIELDS = {
    "timestamp_granularities": "word and segment timestamps are not available from the model's chat engines",
    "timestamp_granularities[]": "word and segment timestamps are not available from the model's chat engines",
    "include": "log probabilities of a transcript are not available from these engines",
    "include[]": "log probabilities of a transcript are not available from these engines",
    "chunking_strategy": "the audio is cut by the gateway's media limits, not by the client",
    "known_speaker_names[]": "speaker labels are not available from these engines",
    "known_speaker_references[]": "speaker labels are not available from these engines",
}
#: a file's extension (or media type's subtype) as ``input_audio.format`` names it
_FORMATS = {
    "wav": "wav",
    "wave": "wav",
    "x-wav": "wav",
    "mp3": "mp3",
    "mpeg": "mp3",
    "mpga": "mp3",
    "flac": "flac",
    "x-flac": "flac",
    "ogg": "ogg",
    "oga": "ogg",
    "opus": "opus",
    "m4a": "m4a",
    "mp4": "mp4",
    "x-m4a": "m4a",
    "aac": "aac",
    "webm": "webm",
}
#: the first bytes of each container, for a file whose name and type say nothing
_MAGIC = (
    (b"RIFF", "wav"),
    (b"fLaC", "flac"),
    (b"OggS", "ogg"),
    (b"ID3", "mp3"),
    (b"\x1a\x45\xdf\xa3", "webm"),
)


#: where the chat request a transcription is served as carries the audio, and a speech request the text
AUDIO_PART = "messages.0.content.0"
TEXT_MESSAGE = "messages.1"


@contextlib.contextmanager
def named_as(part: str, field: str) -> Iterator[None]:
    """An error naming the chat request's ``part`` names the endpoint's ``field`` instead (the client's)."""
    try:
        yield
    except OmnigateError as exc:
        if exc.param is not None and exc.param.startswith(part):
            exc.message = exc.message.replace(exc.param, field)
            exc.param = field
        raise


#: the timestamps a speech-to-text engine gives, as ``timestamp_granularities[]`` names them
GRANULARITIES = ("segment", "word")


def granularities_of(fields: dict[str, str]) -> tuple[str, ...]:
    """The ``timestamp_granularities[]`` asked for, taken out of ``fields`` (repeated values arrive joined
    by commas); whether the model's engines give them is the route's to judge."""
    raw = [
        fields.pop(name)
        for name in ("timestamp_granularities[]", "timestamp_granularities")
        if name in fields
    ]
    asked = [v.strip() for value in raw for v in value.split(",") if v.strip()]
    for value in asked:
        if value not in GRANULARITIES:
            raise InvalidRequest(
                f"timestamp_granularities[]: {value[:32]!r} is not one of segment, word",
                param="timestamp_granularities[]",
            )
    return tuple(g for g in GRANULARITIES if g in asked)


def form_fields(fields: dict[str, str]) -> dict[str, Any]:
    """The form's fields but the file, those this gateway cannot honour refused by name."""
    for name, why in UNSERVED_FIELDS.items():
        if name in fields:
            raise InvalidRequest(f"{name}: {why}", param=name, code="unsupported_field")
    return dict(fields)


def parse(model: type[M], doc: dict[str, Any], ctx: RequestContext, services: Services) -> M:
    """``doc`` as ``model``; unknown fields refused, or dropped and announced (``requests.unknown_fields``)."""
    tenant = ctx.identity.tenant_config
    mode = (
        tenant.unknown_fields if tenant is not None else None
    ) or services.settings.requests.unknown_fields
    unknown = sorted(k for k in doc if k not in model.model_fields)
    if unknown and mode == "drop":
        doc = {k: v for k, v in doc.items() if k in model.model_fields}
        ctx.outputs.response_headers[DROPPED_HEADER] = dropped_header(unknown)
        log.info("request_fields_dropped", fields=unknown)
    elif unknown:
        name = unknown[0][:64]
        raise UnknownField(f"{name}: unknown field; this endpoint does not forward it", param=name)
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        raise validation_to_error(exc.errors()) from None


def audio_of(upload: Upload) -> str | SpooledMedia:
    """The file as ``input_audio.data`` takes it: its spool file, or the base64 of its bytes."""
    if upload.file is None:
        raise InvalidRequest(f"{FILE_FIELD}: the audio file is required", param=FILE_FIELD)
    if upload.size == 0:
        raise InvalidRequest(f"{FILE_FIELD}: the audio file is empty", param=FILE_FIELD)
    if isinstance(upload.file, SpooledMedia):
        return upload.file
    return base64.b64encode(upload.file).decode("ascii")


def format_of(upload: Upload) -> str:
    """The format the upload declares: its name's extension, else its type, else its first bytes.

    What it declares is checked against what the bytes are (media-limits): a ``.mp3`` holding WAV is a
    400, as a chat part declaring one format and carrying another is.
    """
    ext = PurePath(upload.filename).suffix.lower().lstrip(".")
    if ext in _FORMATS:
        return _FORMATS[ext]
    main, _, sub = upload.content_type.lower().partition("/")
    if main == "audio" and sub in _FORMATS:
        return _FORMATS[sub]
    head = upload.head
    for magic, fmt in _MAGIC:
        if head.startswith(magic):
            return fmt
    if head[:1] == b"\xff" and len(head) > 1 and head[1] & 0xE0 == 0xE0:
        return "mp3"  # an MPEG audio frame's sync word
    if head[4:8] == b"ftyp":
        return "m4a"
    return "bin"  # declares nothing: what the bytes are is found by the media steps
