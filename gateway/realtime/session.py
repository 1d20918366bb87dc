"""One ``/v1/realtime`` session: its configuration, its input audio buffer, its conversation, and the client
events that change them; a response runs as a task of its own (gateway/realtime/turn.py) so that speech or
``response.cancel`` can stop it mid-answer.

Everything here is per session and bounded: the buffer by a turn's length, the conversation by
``realtime.max_items``, the audio by the session's total and by real time plus a burst. A client mistake is
answered with an ``error`` event and the session goes on; too many of them, or a limit that protects the
gateway (audio faster than real time, the session's budget), end it with close code 1008 (:class:`Close`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from pydantic import ValidationError

from core.context import RequestContext
from gateway.realtime import events as ev
from gateway.realtime import turn as turns
from gateway.realtime.audio import seconds
from gateway.realtime.conversation import Conversation, Item, SessionConfig
from gateway.realtime.vad import VoiceActivity, shared_model
from gateway.realtime_settings import RealtimeSettings
from observability.metrics import Metrics

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline

log = structlog.get_logger("omnigate.realtime")


class Close(Exception):
    """End the session with this WebSocket close code (1008: policy violation)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class RealtimeSession:
    """A session's state and the handling of its client events. The transport feeds it frames and closes it."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        metrics: Metrics,
        settings: RealtimeSettings,
        ctx: RequestContext,
        session_id: str,
        model: str,
        send: turns.Emit,
    ) -> None:
        self.pipeline, self.metrics, self.settings = pipeline, metrics, settings
        self.ctx, self.id, self._send = ctx, session_id, send
        self.cfg = SessionConfig(model=model)
        self.conversation = Conversation(settings.max_items)
        self.buffer = bytearray()
        self.turns = 0
        self.errors = 0
        self.audio_in_s = 0.0  # all input audio appended this session
        self.audio_out_s = 0.0
        self.started = time.monotonic()
        self._first_append: float | None = None
        self._vad: VoiceActivity | None = None
        self._speech_item: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._turn: turns.Turn | None = None
        self.closed_reason: str | None = None

    # -- the transport's calls ------------------------------------------------------------------
    async def open(self) -> None:
        await self.emit({"type": "session.created", "session": self.cfg.wire(self.id)})

    async def frame(self, text: str | None, data: bytes | None) -> None:
        """One client frame. Raises :class:`Close` when the session must end."""
        if text is None:
            await self.refuse(
                ev.bad(
                    "binary frames are not part of the Realtime protocol; send JSON events",
                    "invalid_frame",
                ),
                None,
            )
            return
        if len(text) > self.settings.max_frame_bytes:
            await self.refuse(
                ev.bad(f"event larger than {self.settings.max_frame_bytes} bytes", "event_too_large"),
                None,
            )
            return
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            await self.refuse(ev.bad("the event is not valid JSON", "invalid_json"), None)
            return
        event_id = (
            doc.get("event_id") if isinstance(doc, dict) and isinstance(doc.get("event_id"), str) else None
        )
        kind = doc.get("type") if isinstance(doc, dict) else None
        if kind not in ev.KNOWN:
            await self.refuse(
                ev.bad(f"unknown or unsupported event type {kind!r}", "invalid_event", "type"),
                event_id,
            )
            return
        try:
            event = ev.CLIENT_EVENT.validate_python(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"][1:]) or None
            await self.refuse(
                ev.bad(f"invalid {kind}: {where or 'event'}: {first['msg']}", "invalid_value", where),
                event_id,
            )
            return
        try:
            await self._handle(event)
        except ev.RealtimeError as exc:
            await self.refuse(exc, event_id)

    async def refuse(self, error: ev.RealtimeError, event_id: str | None) -> None:
        self.errors += 1
        await self.emit(error.event(event_id))
        if error.fatal:
            raise Close(1008, error.code)
        if self.errors >= self.settings.max_errors:
            raise Close(1008, "too many invalid events")

    async def aclose(self) -> None:
        """Stop a response in progress (its engine request is closed): the session ends, however it ended."""
        await self.cancel("closed", None, notify=False)

    async def emit(self, event: dict[str, Any]) -> None:
        event.setdefault("event_id", ev.new_id("event"))
        await self._send(event)

    # -- the events -----------------------------------------------------------------------------
    async def _handle(self, e: ev.ClientEvent) -> None:
        if isinstance(e, ev.BufferAppend):
            await self._append(e.audio)
        elif isinstance(e, ev.BufferCommit):
            await self._commit()
        elif isinstance(e, ev.BufferClear):
            self.buffer.clear()
            await self.emit({"type": "input_audio_buffer.cleared"})
        elif isinstance(e, ev.ResponseCreate):
            await self._respond(e.response)
        elif isinstance(e, ev.ResponseCancel):
            if self._turn is None or self._turn.done or (e.response_id and e.response_id != self._turn.id):
                raise ev.bad("there is no response in progress to cancel", "response_cancel_not_active")
            await self.cancel("client", None)
        elif isinstance(e, ev.SessionUpdate):
            if self.cfg.update(e.session, self.settings.vad):
                self._vad = VoiceActivity(shared_model(), self.cfg.vad) if self.cfg.vad is not None else None
            await self.emit({"type": "session.updated", "session": self.cfg.wire(self.id)})
        elif isinstance(e, ev.ItemCreate):
            await self._create_item(e)
        elif isinstance(e, ev.ItemDelete):
            item = self.conversation.find(e.item_id)
            if item is None:
                raise ev.bad(f"no item {e.item_id!r} in the conversation", "item_not_found", "item_id")
            self.conversation.items.remove(item)
            await self.emit({"type": "conversation.item.deleted", "item_id": e.item_id})
        elif isinstance(e, ev.ItemTruncate):
            await self._truncate(e)

    async def _append(self, b64: str) -> None:
        try:
            pcm = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise ev.bad("audio is not valid base64", "invalid_value", "audio") from None
        if len(pcm) % 2:
            raise ev.bad("audio is PCM16: an even number of bytes", "invalid_value", "audio")
        s, cfg = self.settings, self.cfg
        took = seconds(len(pcm), cfg.in_rate)
        now = time.monotonic()
        if self._first_append is None:
            self._first_append = now
        if self.audio_in_s + took > (now - self._first_append) + s.burst_s:
            raise ev.bad(
                f"audio is arriving faster than real time (more than {s.burst_s:g} s ahead)",
                "input_audio_too_fast",
                fatal=True,
            )
        if self.audio_in_s + took > s.max_audio_s:
            raise ev.bad(
                f"the session's input audio is over its limit of {s.max_audio_s:g} s",
                "session_audio_limit",
                fatal=True,
            )
        if seconds(len(self.buffer) + len(pcm), cfg.in_rate) > s.max_turn_audio_s:
            raise ev.bad(
                f"the input audio buffer holds at most {s.max_turn_audio_s:g} s; commit or clear it",
                "input_audio_buffer_full",
                "audio",
            )
        self.audio_in_s += took
        self.buffer += pcm
        if self._vad is not None:
            for what, at_ms in self._vad.feed(pcm, cfg.in_rate):
                await self._speech(what, at_ms)

    async def _speech(self, what: str, at_ms: int) -> None:
        if what == "started":
            heard = time.perf_counter()
            self._speech_item = ev.new_id("item")
            await self.emit(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": at_ms,
                    "item_id": self._speech_item,
                }
            )
            if self.cfg.interrupt_response and self._turn is not None and not self._turn.done:
                self.metrics.realtime_barge_ins.inc()
                await self.cancel("barge_in", heard)
            return
        item_id = self._speech_item or ev.new_id("item")
        self._speech_item = None
        await self.emit(
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": at_ms, "item_id": item_id}
        )
        await self._commit(item_id)
        if self.cfg.create_response and (self._turn is None or self._turn.done):
            await self._respond(None)

    async def _commit(self, item_id: str | None = None) -> None:
        if not self.buffer:
            raise ev.bad("the input audio buffer is empty", "input_audio_buffer_commit_empty")
        item = Item(item_id or ev.new_id("item"), "user", audio=bytes(self.buffer))
        self.buffer.clear()
        previous = self.conversation.add(item)
        await self.emit(
            {"type": "input_audio_buffer.committed", "item_id": item.id, "previous_item_id": previous}
        )
        await self._added(item, previous)

    async def _added(self, item: Item, previous: str | None) -> None:
        await self.emit(
            {"type": "conversation.item.added", "previous_item_id": previous, "item": item.wire()}
        )
        await self.emit({"type": "conversation.item.done", "previous_item_id": previous, "item": item.wire()})

    async def _create_item(self, e: ev.ItemCreate) -> None:
        item = self.conversation.item_from(e.item)
        took = seconds(len(item.audio), self.cfg.in_rate)
        if took > self.settings.max_turn_audio_s or self.audio_in_s + took > self.settings.max_audio_s:
            raise ev.bad(
                "the item's audio is over the session's limits", "input_audio_too_long", "item.content"
            )
        self.audio_in_s += took
        previous = self.conversation.add(item, e.previous_item_id)
        await self._added(item, previous)

    async def _truncate(self, e: ev.ItemTruncate) -> None:
        item = self.conversation.truncate(e.item_id, e.audio_end_ms)
        await self.emit(
            {
                "type": "conversation.item.truncated",
                "item_id": item.id,
                "content_index": e.content_index,
                "audio_end_ms": e.audio_end_ms,
            }
        )

    # -- responses ----------------------------------------------------------------------------------
    async def _respond(self, params: ev.ResponseParams | None) -> None:
        if self._turn is not None and not self._turn.done:
            raise ev.bad("a response is already in progress", "conversation_already_has_active_response")
        if self.turns >= self.settings.max_turns:
            raise ev.bad(
                f"the session's budget of {self.settings.max_turns} responses is spent",
                "session_turn_limit",
                fatal=True,
            )
        modalities: list[str] = list(
            params.output_modalities if params and params.output_modalities else self.cfg.modalities
        )
        limit = (
            params.max_output_tokens
            if params and params.max_output_tokens is not None
            else self.cfg.max_output_tokens
        )
        try:
            chat = turns.chat_request(
                self.cfg,
                self.conversation,
                modalities,
                params.instructions if params else None,
                None if limit == "inf" else limit,
            )
        except ValidationError as exc:
            raise ev.bad(
                f"the conversation cannot be answered: {exc.errors()[0]['msg']}", "conversation_empty"
            ) from None
        self.turns += 1
        turn = turns.Turn(self.turns, modalities, self.cfg.out_rate)
        last_user = next((i for i in reversed(self.conversation.items) if i.role == "user"), None)
        ctx = turns.turn_context(
            self.ctx, turn, self.id, last_user.audio if last_user else b"", self.cfg.in_rate
        )
        self._turn = turn
        self._task = asyncio.get_running_loop().create_task(
            self._run(turn, ctx, chat), name=f"realtime-{self.id}"
        )

    async def _run(self, turn: turns.Turn, ctx: RequestContext, chat: Any) -> None:
        remaining = self.settings.max_session_s - (time.monotonic() - self.started)
        limits = {
            "name": "requests",
            "limit": self.settings.max_turns,
            "remaining": self.settings.max_turns - self.turns,
            "reset_seconds": round(max(0.0, remaining), 3),
        }
        try:
            await self.emit({"type": "rate_limits.updated", "rate_limits": [limits]})
            for event in turn.opening():
                await self.emit(event)
            try:
                status = await turns.run(self.pipeline, ctx, chat, turn, self.emit)
            except ev.ClientGone:
                raise
            except Exception as exc:  # the session outlives a failed turn: it ends as failed, logged
                log.error("realtime_turn_failed", session_id=self.id, turn=turn.index, exc_info=exc)
                turn.error = {
                    "type": "server_error",
                    "code": "internal_error",
                    "message": "the response failed",
                }
                status = "failed"
            await self._finish(turn, status)
        except ev.ClientGone:
            # Nobody is left to tell; the transport ends the session (its reader was woken by the outbox).
            if not turn.done:
                turn.done = True
                self.metrics.realtime_turns.labels("cancelled").inc()

    async def _finish(self, turn: turns.Turn, status: turns.Status) -> None:
        if turn.done:
            return
        closing = turn.closing(status)  # marks it done before any await
        self.metrics.realtime_turns.labels(status).inc()
        if turn.first_audio_s is not None:
            self.metrics.realtime_first_audio.observe(turn.first_audio_s)
        self.audio_out_s += turn.audio_ms / 1000
        if turn.text or turn.audio_bytes:
            item = Item(
                turn.item_id,
                "assistant",
                text=turn.text,
                audio_ms=turn.audio_ms,
                status="completed" if status == "completed" else "incomplete",
            )
            self.conversation.add(item)
        for event in closing:
            await self.emit(event)

    async def cancel(self, reason: str, heard: float | None, notify: bool = True) -> None:
        """Stop the response in progress: its task is cancelled, and so its engine request closed, before this
        returns; then ``response.done`` says ``cancelled``."""
        task, turn = self._task, self._turn
        if task is None or turn is None or turn.done:
            return
        task.cancel()
        await asyncio.wait([task])
        if heard is not None:
            self.metrics.realtime_barge_in_stop.observe(time.perf_counter() - heard)
        self.metrics.realtime_cancellations.labels(reason).inc()
        if notify:
            await self._finish(turn, "cancelled")
        else:
            turn.done = True
            self.metrics.realtime_turns.labels("cancelled").inc()
