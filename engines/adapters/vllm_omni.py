"""Adapter for vLLM-Omni, whose wire shape differs from OpenAI's (see WIRE.md for the shapes it handles).

Streaming: each chunk carries a top-level ``modality``; audio arrives as base64
WAV in ``delta.content`` (a complete WAV file per piece in 0.30.0, a header on
the first piece only in other builds, ``audio_metadata`` on the choice or not).
With speech the text's last chunk has no ``finish_reason`` and the last audio
chunk carries ``stop``, so a text cut at ``max_tokens`` is judged from usage
against the cap. Not streaming: one merged choice (0.30.0) or two choices that
both say ``index: 0`` (older builds), told apart by what they hold, never by
position. The voice goes as top-level ``voice``/``speaker``, lowercased. A prompt
over the context comes back as HTTP 500 with vLLM's words (0.30.0): it is the
client's 400. All of it becomes :class:`core.events.Delta` so audio can never be
taken for text.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from core.audio import split_wav
from core.errors import EngineFailed, EngineProtocolError, EngineRejected
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from engines.adapters.base import checked_index
from engines.adapters.openai_compat import OpenAICompatEngine, rejection
from engines.adapters.openai_read import choice_completion, read_usage
from engines.adapters.settings import EngineConfig

# vLLM-Omni's answer to a speaker its talker does not have (serving_chat.py), before any chunk.
_INVALID_SPEAKER = re.compile(r"Invalid speaker '([^']*)'\. Supported: (.*)$", re.DOTALL)
# vLLM's refusal of a prompt over the context, which vLLM-Omni 0.30.0 sends as an HTTP 500 (vLLM: 400).
_CONTEXT_OVERFLOW = re.compile(r"maximum context length is \d+ tokens")


class VLLMOmniEngine(OpenAICompatEngine):
    #: only these of vLLM's extras reach the thinker (its other sampling fields keep the stage config's
    #: values): any other is refused for a model only vLLM-Omni serves, not silently lost
    extras = ("min_tokens", "ignore_eos", "stop_token_ids")

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        #: the talker's speakers, lowercased: configured, or learned from the engine's first refusal;
        #: None while unknown (the engine then judges the voice itself)
        self.voices: frozenset[str] | None = (
            frozenset(v.lower() for v in config.voices) if config.voices is not None else None
        )

    def _add_audio(self, body: dict[str, Any], request: ChatCompletionRequest) -> None:
        assert request.audio is not None
        voice = request.audio.voice.lower()
        # vLLM-Omni reads the speaker from the top level only (audio.voice is ignored). WAV always: every
        # piece then says its own rate and channels, and the gateway re-frames it for the client's format.
        body["audio"] = {"voice": voice, "format": "wav"}
        body["voice"] = body["speaker"] = voice

    async def _check_status(self, resp: aiohttp.ClientResponse) -> None:
        try:
            await super()._check_status(resp)
        except EngineFailed as exc:
            if not _CONTEXT_OVERFLOW.search(exc.detail):
                raise
            # The request is what is wrong, not the engine: a 400 (OpenAI's context_length_exceeded), which
            # is not failed over and does not count against the engine's health.
            raise rejection(exc.detail, exc.detail, engine=self.name, upstream_status=400) from exc
        except EngineRejected as exc:
            found = _INVALID_SPEAKER.search(
                exc.detail
            )  # the engine's own words (the message is the public one)
            if found is None:
                raise
            supported = sorted({v.strip().lower() for v in found.group(2).split(",") if v.strip()})
            if supported and self.config.voices is None:
                self.voices = frozenset(supported)
            # The voices are the model's public surface, so the client is told them in the gateway's words.
            message = (
                f"audio.voice {found.group(1)!r} is not one of this model's voices: {', '.join(supported)}"
            )
            refused = EngineRejected(
                message, engine=self.name, upstream_status=400, param="audio.voice", public=message
            )
            refused.code = "invalid_voice"
            raise refused from exc

    async def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
        """The base stream, with the finish reason vLLM-Omni leaves out when speech follows the text."""
        inner = super().stream(request)
        speech = request.wants_audio
        cap = request.output_token_limit
        text_finish: str | None = None
        judged = False
        pieces = 0
        try:
            async for d in inner:
                if d.text:
                    pieces += 1
                if d.finish_reason is not None:
                    text_finish = d.finish_reason
                if speech and d.usage is not None and not (d.text or d.audio or d.finish_reason):
                    judged = True  # the closing usage chunk (text tokens only)
                    # The text stage's stop is not on the wire: completion_tokens (text only) at the cap means
                    # the text was cut there, whatever the audio chunk's "stop" says.
                    if cap is not None and d.usage.completion_tokens >= cap and text_finish in (None, "stop"):
                        d = Delta(finish_reason="length", usage=d.usage)
                yield d
            if speech and not judged and cap is not None and pieces >= cap and text_finish in (None, "stop"):
                yield Delta(finish_reason="length")  # no usage chunk: every text piece is at least one token
        finally:
            await inner.aclose()

    def _choice_delta(
        self,
        chunk: dict[str, Any],
        choice: dict[str, Any],
        usage: dict[str, Any] | None,
        state: dict[str, Any],
    ) -> Delta | None:
        modality = chunk.get("modality")
        if modality != "audio":
            if modality is None and not (choice.get("delta") or {}).get("content"):
                # A bare closing chunk (some builds): the stop of whatever came last, with no usage of its own.
                finish = choice.get("finish_reason")
                return Delta(finish_reason=finish, audio_done=bool(state.get("audio"))) if finish else None
            # Usage on a text chunk counts text tokens; the choice's extras (token_ids, ...) are not read.
            return super()._choice_delta(chunk, choice, usage, state)
        # Audio: base64 WAV in delta.content. It must never be read as text, and its usage (0 tokens) is not kept.
        content = (choice.get("delta") or {}).get("content") or ""
        finish = choice.get("finish_reason")
        pcm = b""
        if content:
            pcm, state["rate"], state["channels"] = _decode_audio(
                content,
                choice.get("audio_metadata") or {},
                state.get("rate"),
                state.get("channels"),
                self.name,
            )
            state["audio"] = True
        if not pcm and finish is None:
            return None
        return Delta(audio=pcm, sample_rate=state.get("rate") or 0, channels=state.get("channels") or 1,
                     audio_done=finish is not None)  # fmt: skip

    def _completion(self, doc: dict[str, Any], n: int) -> Completion:
        out = Completion(usage=read_usage(doc.get("usage") or {}))
        # The stages' choices share one index (older builds), which must still be one of the request's.
        for choice in doc["choices"]:
            checked_index(choice.get("index", 0), n, "a choice", self.name)
        text_finish: str | None = None
        audio_finish: str | None = None
        # One merged choice (0.30.0) or a text choice and an audio choice, both "index": 0, in the order the
        # stages finished: each choice is read for what it holds.
        for choice in doc["choices"]:
            message = choice.get("message") or {}
            audio = message.get("audio")
            if isinstance(audio, dict) and audio.get("data"):
                pcm, rate, channels = _decode_audio(audio["data"], choice.get("audio_metadata") or {}, None, None,
                                                    self.name)  # fmt: skip
                out.audio += pcm
                out.sample_rate, out.channels = rate, channels
                out.transcript += audio.get("transcript") or ""
                audio_finish = choice.get("finish_reason") or audio_finish
            content = message.get("content")
            if (
                (isinstance(content, str) and content)
                or message.get("tool_calls")
                or any(message.get(k) for k in ("reasoning_content", "reasoning"))
            ):
                # The text stage's message is vLLM's (tool calls, reasoning and logprobs included).
                part = choice_completion(choice)
                out.text += part.text
                out.tool_calls += part.tool_calls
                if part.reasoning:
                    out.reasoning, out.reasoning_key = out.reasoning + part.reasoning, part.reasoning_key
                if part.logprobs is not None:
                    out.logprobs = (out.logprobs or []) + part.logprobs
                text_finish = choice.get("finish_reason") or text_finish
        out.finish_reason = text_finish or audio_finish or "stop"
        return out


def _decode_audio(
    b64: str, meta: dict[str, Any], rate: int | None, channels: int | None, engine: str
) -> tuple[bytes, int, int]:
    """PCM16, sample rate and channels of one audio piece; a headerless piece takes the rate already known."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineProtocolError(f"engine {engine} sent audio that is not base64", engine=engine) from exc
    if raw[:4] == b"RIFF":
        return split_wav(raw)
    fmt = str(meta.get("format") or "").lower()
    if fmt not in ("", "wav", "pcm", "pcm16"):
        raise EngineProtocolError(
            f"engine {engine} sent audio as {fmt!r}; the gateway asks for wav", engine=engine
        )
    # A build that sends the WAV header on the first piece only: the rest is bare PCM at the header's rate.
    rate = int(meta.get("sample_rate_hz") or 0) or rate
    channels = int(meta.get("channels") or 0) or channels or 1
    if not rate:
        raise EngineProtocolError(
            f"engine {engine} sent headerless audio without a sample rate", engine=engine
        )
    return raw, rate, channels
