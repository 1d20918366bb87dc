"""A decoding worker's output as a content part: a data URI, or (when large) a part carrying a spooled file.

None of it runs for a request without media parts; :mod:`policies.media.parts` re-exports the names.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from core.schemas import AudioURLPart, ImagePart, InputAudio, InputAudioPart, URLRef, VideoURLPart
from core.spooled import SpooledMedia, SpoolFull, SpoolWriter
from policies.media.shared import SharedOut, write_out


def data_uri(mediatype: str, data: bytes) -> str:
    return f"data:{mediatype};base64," + base64.b64encode(data).decode("ascii")


#: an output part this large comes back from a worker as bytes and goes to the spool, not into a string
SPOOL_OUTPUT = 1 << 18


@dataclass(frozen=True, slots=True)
class Output:
    """A worker's large output before it is a part: its bytes (``data``), or only its ``size`` where the
    worker wrote them into the file the parent reserved for it (:class:`~policies.media.shared.SharedOut`). Either way
    the gateway makes it a part carrying a spooled file (:func:`spool_parts`), never a base64 string."""

    ref_type: str
    mediatype: str
    size: int
    audio_format: str | None = None
    data: bytes | None = None

    @property
    def chars(self) -> int:
        """The length of the data URI it stands for."""
        return len(f"data:{self.mediatype};base64,") + (self.size + 2) // 3 * 4


def output_part(
    ref_type: str, mediatype: str, data: bytes, audio_format: str | None = None, out: SharedOut | None = None
) -> Any:
    """The part carrying a worker's output: written into ``out`` where the parent reserved one and it
    fits, else (from :data:`SPOOL_OUTPUT`) its bytes as an :class:`Output`, else a data URI."""
    if len(data) < SPOOL_OUTPUT:
        return make_part(ref_type, data_uri(mediatype, data), audio_format)
    if out is not None and write_out(out, data):
        return Output(ref_type, mediatype, len(data), audio_format)
    return Output(ref_type, mediatype, len(data), audio_format, data)


def spool_parts(parts: list[Any], out: SpoolWriter | None = None) -> list[Any]:
    """Parts with each :class:`Output` made a part carrying its spooled file: the one reserved for it
    (``out``, discarded when the worker did not use it) or a new one."""
    made = [_spooled(p, out) if isinstance(p, Output) else p for p in parts]
    if out is not None and not any(isinstance(p, Output) and p.data is None for p in parts):
        out.discard()
    return made


def _spooled(o: Output, out: SpoolWriter | None) -> Any:
    # input_audio carries plain base64 (its format beside it); the other parts a data URI
    header = "" if o.ref_type == "input_audio" else f"data:{o.mediatype};base64,"
    b64_length = (o.size + 2) // 3 * 4
    if o.data is None:
        assert out is not None, "a worker wrote into a file the parent did not reserve"
        out.wrote(o.size)
        return make_part(o.ref_type, out.finish(header, b64_length), o.audio_format)
    try:
        writer = SpoolWriter()
        writer.write(o.data)
    except SpoolFull:
        return make_part(o.ref_type, data_uri(o.mediatype, o.data), o.audio_format)
    return make_part(o.ref_type, writer.finish(header, b64_length), o.audio_format)


def make_part(ref_type: str, uri: str | SpooledMedia, audio_format: str | None = None) -> Any:
    """A content part of the client's type carrying ``uri`` (input_audio takes plain base64 and a format)."""
    if ref_type == "image_url":
        return ImagePart(type="image_url", image_url=URLRef(url=uri))
    if ref_type == "audio_url":
        return AudioURLPart(type="audio_url", audio_url=URLRef(url=uri))
    if ref_type == "video_url":
        return VideoURLPart(type="video_url", video_url=URLRef(url=uri))
    if ref_type == "input_audio":
        if isinstance(uri, SpooledMedia):
            # the client's own plain base64, spooled (a data URI's payload is re-encoded by the caller)
            assert not uri.header
            payload: str | SpooledMedia = uri
        else:
            payload = uri.partition(",")[2] if uri.startswith("data:") else uri
        return InputAudioPart(
            type="input_audio", input_audio=InputAudio(data=payload, format=audio_format or "wav")
        )
    raise ValueError(ref_type)
