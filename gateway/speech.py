"""What a speech request may ask for, checked before any engine work: a format the gateway can serve, a known voice.

Engines always hand the gateway PCM (vLLM-Omni is asked for WAV), and the gateway
encodes what the client asked for (``core.audio.encode``); a format it cannot
encode would cost the engine its work and the client a 500, so it is a 400 here.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.audio import ENCODABLE_FORMATS, STREAMABLE_FORMATS
from core.errors import InvalidRequest
from core.schemas import ChatCompletionRequest
from engines.adapters.base import Engine


def check_speech(request: ChatCompletionRequest, engines: Iterable[Engine]) -> None:
    """Refuse speech the model's engines cannot serve (``engines``: those serving the requested model)."""
    if not request.wants_audio or request.audio is None:
        return
    fmt = request.audio.format
    if request.stream and fmt not in STREAMABLE_FORMATS:
        raise InvalidRequest(f"streamed audio must be wav or pcm16, not {fmt}", param="audio.format")
    if fmt not in ENCODABLE_FORMATS:
        served = ", ".join(sorted(ENCODABLE_FORMATS - {"pcm"}))
        raise InvalidRequest(
            f"audio.format {fmt} cannot be served; use one of {served}", param="audio.format"
        )
    # Only engines that list their voices can judge one; any engine that cannot leaves it to the engines.
    listed = [getattr(e, "voices", None) for e in engines if e.capabilities.speaks]
    known: list[frozenset[str]] = [frozenset(v) for v in listed if v is not None]
    if not known or len(known) < len(listed):
        return
    voice = request.audio.voice.lower()
    if not any(voice in v for v in known):
        choices = ", ".join(sorted(set().union(*known)))
        raise InvalidRequest(
            f"audio.voice {request.audio.voice!r} is not one of this model's voices: {choices}",
            param="audio.voice", code="invalid_voice",
        )  # fmt: skip
