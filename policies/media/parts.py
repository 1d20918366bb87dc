"""Finding the media parts of a request, and data URIs in and out.

A media part is named by its JSON path (``messages.0.content.1``); every error
about it carries that path as ``param`` so a client knows which part was refused.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidMedia
from core.schemas import ChatCompletionRequest, InputAudioPart, Message
from core.spooled import SpooledMedia
from policies.media.container import AUDIO_FORMATS
from policies.media.outputs import SPOOL_OUTPUT as SPOOL_OUTPUT
from policies.media.outputs import Output as Output
from policies.media.outputs import data_uri as data_uri
from policies.media.outputs import make_part as make_part
from policies.media.outputs import output_part as output_part
from policies.media.outputs import spool_parts as spool_parts
from policies.media.shared import SharedBytes

_KIND = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}
_MEDIATYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}$")
# Matched in place (``fullmatch(text, pos)``): a part's payload is never sliced or re-encoded to be checked.
_B64_CHARS = re.compile(r"[A-Za-z0-9+/]*={0,2}")


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media part: where it is, what it is, and its URL or base64 payload as the client sent it."""

    message: int
    index: int
    kind: str  # image | audio | video
    type: str  # the content-part type
    #: the URL / data URI (or, for input_audio, base64 or a data URI); a long payload is a SpooledMedia
    value: str | SpooledMedia
    declared_format: str | None = None  # input_audio.format, when the client set it

    @property
    def path(self) -> str:
        return f"messages.{self.message}.content.{self.index}"

    @property
    def param(self) -> str:
        field = {
            "image_url": "image_url.url",
            "audio_url": "audio_url.url",
            "video_url": "video_url.url",
            "input_audio": "input_audio.data",
        }[self.type]
        return f"{self.path}.{field}"

    @property
    def is_remote(self) -> bool:
        if isinstance(self.value, SpooledMedia):
            return False  # spooled from the body: a data URI's payload by construction
        return self.type != "input_audio" and not self.value.startswith("data:")

    @property
    def url(self) -> str:
        """A remote part's URL (what :attr:`is_remote` found); a part carried in the body has none."""
        if not self.is_remote or not isinstance(self.value, str):
            raise ValueError(f"{self.param} is carried in the request, not fetched")
        return self.value

    @property
    def head(self) -> str:
        """The start of the client's string: enough for its data URI's header."""
        value = self.value
        return value.header if isinstance(value, SpooledMedia) else value[:_MAX_HEADER]


def media_parts(request: ChatCompletionRequest) -> Iterator[MediaRef]:
    for mi, message in enumerate(request.messages):
        if not isinstance(message.content, list):
            continue
        for pi, part in enumerate(message.content):
            kind = _KIND.get(part.type)
            if kind is None:
                continue
            if isinstance(part, InputAudioPart):
                audio = part.input_audio
                declared = audio.format if "format" in audio.model_fields_set else None
                yield MediaRef(mi, pi, kind, part.type, audio.data, declared)
            else:
                yield MediaRef(mi, pi, kind, part.type, getattr(part, part.type).url)


def declared_type(ref: MediaRef) -> str | None:
    """The media type the client declared for the part: its data URI's, else ``input_audio.format``'s."""
    head = ref.head
    if head.startswith("data:"):
        comma = head.find(",", 5, _MAX_HEADER)
        mediatype = head[5 : comma if comma >= 0 else _MAX_HEADER].split(";")[0].strip().lower()
        if mediatype:
            return mediatype
    if ref.declared_format is not None:
        return AUDIO_FORMATS.get(ref.declared_format.strip().lower())
    return None


def decode_payload(ref: MediaRef) -> bytes:
    """The bytes of a data URI (or of input_audio's plain base64); a 400 naming the part otherwise.

    The payload is checked where it lies in the client's string and decoded without str slices:
    besides the decoded bytes, a data URI costs one transient byte copy of itself, plain base64 none.
    """
    if isinstance(ref.value, SpooledMedia):
        return _checked(ref, ref.value).read()
    text, start = _payload(ref)
    return _decode(text, start, ref.param)


def payload_arg(ref: MediaRef) -> bytes | SharedBytes:
    """The part's bytes as a decoding worker's argument: a spooled part's file by name, never read here."""
    if isinstance(ref.value, SpooledMedia):
        media = _checked(ref, ref.value)
        return SharedBytes(media.name, media.size)
    return decode_payload(ref)


def _checked(ref: MediaRef, media: SpooledMedia) -> SpooledMedia:
    """A spooled payload's header checked as a data URI's is (its base64 was checked as it arrived)."""
    if media.header:
        _data_header(media.header, ref.param)
    elif ref.type != "input_audio":
        raise InvalidMedia(f"{ref.param}: expected a data URI", param=ref.param)
    return media


def payload_size(ref: MediaRef) -> int:
    """The number of bytes ``decode_payload`` would return, with the same checks, decoding nothing."""
    if isinstance(ref.value, SpooledMedia):
        return _checked(ref, ref.value).size
    text, start = _payload(ref)
    _check_b64(text, start, ref.param)
    n = len(text) - start
    return n // 4 * 3 - (2 if text.endswith("==") else 1 if text.endswith("=") else 0)


def decode_payload_into(ref: MediaRef, buf: memoryview) -> int:
    """Decode the part into ``buf`` (at least ``payload_size(ref)`` long) a piece at a time; its length.

    For a part bound for the decoding workers: the only allocation is one piece of the payload and
    its bytes, never a copy of the whole part beside the buffer.
    """
    text, start = _payload(ref)
    _check_b64(text, start, ref.param)
    pos = 0
    for i in range(start, len(text), _PIECE):
        try:
            piece = binascii.a2b_base64(text[i : i + _PIECE], strict_mode=True)
        except (binascii.Error, ValueError):
            raise InvalidMedia(f"{ref.param}: malformed base64", param=ref.param) from None
        buf[pos : pos + len(piece)] = piece
        pos += len(piece)
    return pos


#: characters of base64 decoded at a time into a buffer (a multiple of 4: pieces decode on their own)
_PIECE = 1 << 20


def parse_data_uri(uri: str, param: str) -> tuple[str, bytes]:
    """``data:<type>[;params];base64,<payload>`` -> (media type, bytes). Only base64 payloads are media."""
    mediatype, start = _data_header(uri, param)
    return mediatype, _decode(uri, start, param)


#: a data URI's header (``data:<type>;<params>,``) is short; a longer one is refused, never searched
_MAX_HEADER = 512


def _data_header(uri: str, param: str) -> tuple[str, int]:
    """(media type, where the payload starts) of a base64 data URI."""
    if not uri.startswith("data:"):
        raise InvalidMedia(f"{param}: expected a data URI", param=param)
    comma = uri.find(",", 5, _MAX_HEADER)
    if comma < 0:
        raise InvalidMedia(f"{param}: malformed data URI (no comma)", param=param)
    fields = uri[5:comma].split(";")
    mediatype = fields[0].strip().lower() or "application/octet-stream"
    if not _MEDIATYPE.match(mediatype):
        raise InvalidMedia(f"{param}: malformed data URI media type {mediatype[:40]!r}", param=param)
    if "base64" not in (f.strip().lower() for f in fields[1:]):
        raise InvalidMedia(f"{param}: media data URIs must be base64-encoded", param=param)
    return mediatype, comma + 1


def _payload(ref: MediaRef) -> tuple[str, int]:
    assert isinstance(ref.value, str), "a spooled part is read from its file"
    if ref.type == "input_audio" and not ref.value.startswith("data:"):
        return ref.value, 0
    return ref.value, _data_header(ref.value, ref.param)[1]


def _decode(text: str, start: int, param: str) -> bytes:
    _check_b64(text, start, param)
    # A slice of a str is a copy: a data URI's bytes, viewed from the payload on, are the one transient
    # copy (none for plain base64: a2b_base64 reads an ASCII str as it is).
    source: Any = text if start == 0 else memoryview(text.encode("ascii"))[start:]
    try:
        return binascii.a2b_base64(source, strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidMedia(f"{param}: malformed base64", param=param) from None


def _check_b64(text: str, start: int, param: str) -> None:
    if not text.isascii() or (len(text) - start) % 4 != 0 or not _B64_CHARS.fullmatch(text, start):
        raise InvalidMedia(f"{param}: malformed base64", param=param)
    if len(text) == start:
        raise InvalidMedia(f"{param}: the media is empty", param=param)


def replace_parts(
    request: ChatCompletionRequest, new: dict[tuple[int, int], list[Any]]
) -> ChatCompletionRequest:
    """The request with each (message, index) part replaced by the given list of parts."""
    if not new:
        return request
    messages: list[Message] = []
    for mi, message in enumerate(request.messages):
        if not isinstance(message.content, list) or not any(k[0] == mi for k in new):
            messages.append(message)
            continue
        content: list[Any] = []
        for pi, part in enumerate(message.content):
            content.extend(new.get((mi, pi), [part]))
        messages.append(message.model_copy(update={"content": content}))
    return request.model_copy(update={"messages": messages})
