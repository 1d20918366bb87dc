"""Adapter for vLLM-Omni, whose wire shape differs from OpenAI's.

Streaming: each chunk carries a top-level ``modality``; audio arrives as base64
(WAV) in ``delta.content`` with ``audio_metadata`` on the choice, and text and
audio end with their own ``finish_reason``. Not streaming: text and audio come
as two choices. The voice is read from a top-level ``voice``. This adapter turns
all of it into :class:`engines.base.Delta` so audio can never be taken for text.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from engines.base import Completion, Delta
from engines.openai_compat import OpenAICompatEngine, _usage
from gateway.audio import split_wav
from gateway.errors import EngineProtocolError
from gateway.schemas import ChatCompletionRequest

# vLLM-Omni takes these names; the gateway always asks for WAV (or raw PCM) so it
# can re-frame the audio for the client's requested format itself.
_ENGINE_FORMAT = {"pcm16": "pcm", "pcm": "pcm"}


class VLLMOmniEngine(OpenAICompatEngine):
    def _add_audio(self, body: dict[str, Any], request: ChatCompletionRequest) -> None:
        assert request.audio is not None
        fmt = _ENGINE_FORMAT.get(request.audio.format, "wav")
        body["audio"] = {"voice": request.audio.voice, "format": fmt}
        body["voice"] = request.audio.voice

    def _choice_delta(
        self, chunk: dict[str, Any], choice: dict[str, Any], usage: dict[str, Any] | None, state: dict[str, Any]
    ) -> Delta | None:
        if chunk.get("modality") != "audio":
            return super()._choice_delta(chunk, choice, usage, state)
        # Audio: base64 WAV (or PCM) in delta.content. It must never be read as text.
        content = (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason")
        meta = choice.get("audio_metadata") or {}
        rate = int(meta.get("sample_rate_hz") or state.get("rate", 24000))
        channels = int(meta.get("channels") or state.get("channels", 1))
        pcm = b""
        if content:
            pcm, rate, channels = _decode_audio(content, meta, rate, channels, self.name)
        state["rate"], state["channels"] = rate, channels
        if not pcm and finish is None:
            return None
        return Delta(audio=pcm, sample_rate=rate, channels=channels, audio_done=finish is not None)

    def _completion(self, doc: dict[str, Any]) -> Completion:
        usage = doc.get("usage") or {}
        out = Completion(usage=_usage(usage))
        for choice in doc["choices"]:
            message = choice.get("message") or {}
            audio = message.get("audio")
            if audio and audio.get("data"):
                pcm, rate, channels = _decode_audio(audio["data"], {}, 24000, 1, self.name)
                out.audio, out.sample_rate, out.channels = pcm, rate, channels
                out.transcript = audio.get("transcript") or ""
            elif message.get("content"):
                out.text = message["content"]
                out.finish_reason = choice.get("finish_reason") or "stop"
        return out


def _decode_audio(b64: str, meta: dict[str, Any], rate: int, channels: int, engine: str) -> tuple[bytes, int, int]:
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineProtocolError(f"engine {engine} sent audio that is not base64", engine=engine) from exc
    fmt = (meta.get("format") or "").lower()
    if raw[:4] == b"RIFF" or fmt == "wav":
        return split_wav(raw)
    if fmt in ("", "pcm", "pcm16"):
        return raw, rate, channels
    raise EngineProtocolError(f"engine {engine} sent audio as {fmt!r}; configure wav or pcm", engine=engine)
