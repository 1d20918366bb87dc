"""One response of a realtime session: a streamed chat completion through the pipeline, rendered as the
Realtime protocol's response events.

The request is the conversation so far (committed user audio as ``input_audio`` WAV parts, assistant turns
as the text they spoke), so the turn runs every guard a chat request runs: pre-policies (media limits, the
audio screen), load shedding (text-only above the soft limit), the stream filters (the speech gate), the
post checks and its own audit record (with the session id, the turn index and the audio's digests and
durations). It borrows the session's admission slot instead of taking one of its own.
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import structlog

from core.context import DEGRADED_TEXT_ONLY, Identity, LoadSnapshot, RequestContext
from core.errors import OmnigateError
from core.schemas import ChatCompletionRequest
from gateway.realtime.audio import Resampler, digest, seconds, wav_b64
from gateway.realtime.events import ClientGone, new_id

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline
    from gateway.realtime.conversation import Conversation, SessionConfig

log = structlog.get_logger("omnigate.realtime")

Emit = Callable[[dict[str, Any]], Awaitable[None]]
Status = Literal["completed", "cancelled", "failed", "incomplete"]


class Borrowed:
    """The session's admission slot, lent to one of its turns: the turn's holdings give back nothing of it
    (the session's own exit stack does, when the session ends)."""

    def release(self) -> None:
        return None


@dataclass(slots=True)
class Turn:
    """A response in progress: the assistant item it makes, and what of it went out."""

    index: int
    modalities: list[str]
    out_rate: int
    id: str = field(default_factory=lambda: new_id("resp"))
    item_id: str = field(default_factory=lambda: new_id("item"))
    started: float = field(default_factory=time.perf_counter)
    text: str = ""
    audio_bytes: int = 0
    first_audio_s: float | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    #: its content part was announced (once the pipeline said what the answer will be: speech, or text only)
    part_open: bool = False
    #: the chat request's id (its audit record's request_id)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def audio_ms(self) -> int:
        return int(seconds(self.audio_bytes, self.out_rate) * 1000)

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def item(self, status: str) -> dict[str, Any]:
        part: dict[str, Any] = (
            {"type": "output_audio", "transcript": self.text}
            if self.audio
            else {"type": "output_text", "text": self.text}
        )
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if self.part_open else [],
        }

    def response(self, status: str, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": None,
            "output": output or [],
            "conversation_id": None,
            "output_modalities": ["audio"] if self.audio else ["text"],
            "usage": self.usage,
        }
        if status == "cancelled":
            body["status_details"] = {"type": "cancelled", "reason": "turn_detected"}
        elif status == "failed" and self.error is not None:
            body["status_details"] = {"type": "failed", "error": self.error}
        return body

    def part_added(self, text_only: bool) -> dict[str, Any]:
        """The answer's content part, once the pipeline has decided what it is (``text_only``: shed to text
        above the soft limit, though the session asked for speech)."""
        if text_only:
            self.modalities = ["text"]
        self.part_open = True
        part = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
        return {"type": "response.content_part.added", **self._ids(), "part": part}

    def opening(self) -> list[dict[str, Any]]:
        return [
            {"type": "response.created", "response": self.response("in_progress")},
            {
                "type": "response.output_item.added",
                "response_id": self.id,
                "output_index": 0,
                "item": self.item("in_progress"),
            },
            {"type": "conversation.item.added", "previous_item_id": None, "item": self.item("in_progress")},
        ]

    def text_delta(self, text: str) -> dict[str, Any]:
        self.text += text
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        return {"type": kind, **self._ids(), "delta": text}

    def audio_delta(self, pcm: bytes) -> dict[str, Any]:
        if self.first_audio_s is None:
            self.first_audio_s = time.perf_counter() - self.started
        self.audio_bytes += len(pcm)
        return {
            "type": "response.output_audio.delta",
            **self._ids(),
            "delta": base64.b64encode(pcm).decode("ascii"),
        }

    def closing(self, status: Status) -> list[dict[str, Any]]:
        """The events that end the response (sent for a cancelled or failed one too, as OpenAI does); one that
        ended before its answer began has no content part to close."""
        self.done = True
        events: list[dict[str, Any]] = []
        if self.part_open and self.audio:
            events.append({"type": "response.output_audio.done", **self._ids()})
            events.append(
                {"type": "response.output_audio_transcript.done", **self._ids(), "transcript": self.text}
            )
            events.append(
                {
                    "type": "response.content_part.done",
                    **self._ids(),
                    "part": {"type": "audio", "transcript": self.text},
                }
            )
        elif self.part_open:
            events.append({"type": "response.output_text.done", **self._ids(), "text": self.text})
            events.append(
                {
                    "type": "response.content_part.done",
                    **self._ids(),
                    "part": {"type": "text", "text": self.text},
                }
            )
        item = self.item("completed" if status == "completed" else "incomplete")
        events += [
            {"type": "response.output_item.done", "response_id": self.id, "output_index": 0, "item": item},
            {"type": "conversation.item.done", "previous_item_id": None, "item": item},
            {"type": "response.done", "response": self.response(status, [item])},
        ]
        return events


def chat_request(
    cfg: SessionConfig,
    conversation: Conversation,
    modalities: list[str],
    instructions: str | None,
    max_tokens: int | None,
    context_audio_s: float = float("inf"),
    engine_rate: int | None = None,
) -> ChatCompletionRequest:
    """The conversation so far as one streamed chat completion request. Its user audio is the newest turns'
    up to ``context_audio_s`` seconds: an older turn's audio leaves the context (the answer to it stays); each
    turn's audio at ``engine_rate`` where the conversation resampled it to it."""
    messages: list[dict[str, Any]] = []
    system = instructions if instructions is not None else cfg.instructions
    if system:
        messages.append({"role": "system", "content": system})
    heard: set[int] = set()  # the items whose audio is sent, newest first within the budget
    budget = context_audio_s
    for at in range(len(conversation.items) - 1, -1, -1):
        took = seconds(len(conversation.items[at].audio), conversation.items[at].rate)
        if took and (took <= budget or not heard):  # the newest turn's audio is always heard
            heard.add(at)
            budget -= took
        elif took:
            break
    for at, item in enumerate(conversation.items):
        if item.role == "assistant":
            if item.text:
                messages.append({"role": "assistant", "content": item.text})
            continue
        if item.role == "system":
            messages.append({"role": "system", "content": item.text})
            continue
        parts: list[dict[str, Any]] = []
        if item.audio and at in heard:
            pcm, rate = item.audio_at(engine_rate)
            parts.append(
                {"type": "input_audio", "input_audio": {"data": wav_b64(pcm, rate), "format": "wav"}}
            )
        if item.text:
            parts.append({"type": "text", "text": item.text})
        if parts:
            messages.append({"role": "user", "content": parts})
    body: dict[str, Any] = {
        "model": cfg.model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "modalities": ["text", "audio"] if "audio" in modalities else ["text"],
    }
    if "audio" in modalities and cfg.voice:
        body["audio"] = {"voice": cfg.voice, "format": "wav"}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return ChatCompletionRequest.model_validate(body)


def turn_context(
    session: RequestContext, turn: Turn, session_id: str, audio_in: bytes, in_rate: int
) -> RequestContext:
    """The turn's own request context: the session's caller and load, its slot borrowed, its record marked."""
    identity: Identity = dataclasses.replace(session.identity, request_id=turn.request_id)
    ctx = RequestContext(identity)
    load: LoadSnapshot | None = session.load
    ctx.load = load
    if session.admission is not None:
        ctx.admission = Borrowed()
    if session.record.admission is not None:
        ctx.record.admission = dict(session.record.admission)
    ctx.record.realtime = {
        "session_id": session_id,
        "turn": turn.index,
        "audio_in": {"sha256": digest(audio_in), "seconds": round(seconds(len(audio_in), in_rate), 3)}
        if audio_in
        else None,
    }
    return ctx


async def run(
    pipeline: Pipeline, ctx: RequestContext, chat: ChatCompletionRequest, turn: Turn, emit: Emit
) -> Status:
    """Stream the answer as events; returns how it ended. A cancellation (barge-in, ``response.cancel``, the
    client gone) goes on to the caller, after the pipeline closed the engine request."""
    resample = Resampler(turn.out_rate)
    async with pipeline.lifetime(ctx) as stack:
        try:
            stream = await pipeline.stream(chat, ctx)
        except OmnigateError as exc:
            turn.error = {"type": exc.type, "code": exc.code, "message": exc.message}
            return "failed"
        stack.push_async_callback(stream.aclose)
        del chat
        await emit(turn.part_added(turn.audio and DEGRADED_TEXT_ONLY in ctx.outputs.degraded))
        try:
            async for batch in stream.batches():
                for d in batch:
                    if d.index:
                        continue
                    if d.text:
                        await emit(turn.text_delta(d.text))
                    if d.audio and turn.audio:
                        pcm = resample(d.audio, d.sample_rate, d.channels)
                        if pcm:
                            await emit(turn.audio_delta(pcm))
                    if d.usage is not None:
                        turn.usage = _usage(d.usage.prompt_tokens, d.usage.completion_tokens)
            tail = resample.flush()
            if tail:
                await emit(turn.audio_delta(tail))
        except ClientGone:
            raise  # nobody to tell: the transport ends the session
        except OmnigateError as exc:
            turn.error = {"type": exc.type, "code": exc.code, "message": exc.message}
            return "failed"
    return "completed"


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "total_tokens": prompt + completion,
        "input_tokens": prompt,
        "output_tokens": completion,
        "input_token_details": None,
        "output_token_details": None,
    }
