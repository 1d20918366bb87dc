"""One ``/v1/realtime`` session: its configuration, its input audio buffer, its conversation, and the client
events that change them. Its responses run one at a time, each a task of its own
(gateway/realtime/responses.py), so that speech or ``response.cancel`` can stop one mid-answer.

Everything here is per session and bounded: the buffer by a turn's length, the conversation by
``realtime.max_items``, the audio by the session's total and by real time plus a burst. A client mistake is
answered with an ``error`` event and the session goes on; too many of them, or a limit that protects the
gateway (audio faster than real time, the session's budget), end it with close code 1008 (:class:`Close`).
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from core.context import RequestContext
from gateway.realtime import events as ev
from gateway.realtime.audio import seconds
from gateway.realtime.conversation import Conversation, Item, SessionConfig
from gateway.realtime.responses import Responses
from gateway.realtime.turn import Emit
from gateway.realtime_settings import RealtimeSettings
from observability.metrics import Metrics

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline
    from gateway.realtime.passthrough import Relay
    from gateway.realtime.vad import VoiceActivity


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
        send: Emit,
        relay: Relay | None = None,
    ) -> None:
        self.metrics, self.settings = metrics, settings
        self.ctx, self.id, self._send = ctx, session_id, send
        self.cfg = SessionConfig(model=model)
        self.conversation = Conversation(settings.max_items)
        self.buffer = bytearray()
        self.errors = 0
        self.audio_in_s = 0.0  # all input audio appended this session
        self.responses = Responses(
            pipeline, metrics, settings, ctx, session_id, self.emit, self.conversation, relay
        )
        self._first_append: float | None = None
        self._vad: VoiceActivity | None = None
        self._speech_item: str | None = None

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
        await self.responses.cancel("closed", None, notify=False)

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
            await self.responses.start(self.cfg, e.response)
        elif isinstance(e, ev.ResponseCancel):
            active = self.responses.active
            if active is None or (e.response_id and e.response_id != active.id):
                raise ev.bad("there is no response in progress to cancel", "response_cancel_not_active")
            await self.responses.cancel("client", None)
        elif isinstance(e, ev.SessionUpdate):
            fmt = e.session.audio.input.format if e.session.audio and e.session.audio.input else None
            if fmt is not None and fmt.rate != self.cfg.in_rate and self.buffer:
                raise ev.bad(
                    "commit or clear the input audio buffer before changing its rate",
                    "invalid_value",
                    "session.audio.input.format.rate",
                )
            if self.cfg.update(e.session, self.settings.vad):
                self._vad = _voice_activity(self.cfg)
            await self.emit({"type": "session.updated", "session": self.cfg.wire(self.id)})
        elif isinstance(e, ev.ItemCreate):
            await self._create_item(e)
        elif isinstance(e, ev.ItemDelete):
            item = self.conversation.find(e.item_id)
            if item is None:
                raise ev.bad(f"no item {e.item_id!r} in the conversation", "item_not_found", "item_id")
            self.conversation.items.remove(item)
            await self.emit({"type": "conversation.item.deleted", "item_id": e.item_id})
        elif isinstance(e, ev.ItemRetrieve):
            found = self.conversation.find(e.item_id)
            if found is None:
                raise ev.bad(f"no item {e.item_id!r} in the conversation", "item_not_found", "item_id")
            await self.emit({"type": "conversation.item.retrieved", "item": found.wire(with_audio=True)})
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
            if self.cfg.interrupt_response and self.responses.active is not None:
                self.metrics.realtime_barge_ins.inc()
                await self.responses.cancel("barge_in", heard)
            return
        item_id = self._speech_item or ev.new_id("item")
        self._speech_item = None
        await self.emit(
            {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": at_ms, "item_id": item_id}
        )
        await self._commit(item_id)
        if self.cfg.create_response and self.responses.active is None:
            await self.responses.start(self.cfg, None)

    async def _commit(self, item_id: str | None = None) -> None:
        if not self.buffer:
            raise ev.bad("the input audio buffer is empty", "input_audio_buffer_commit_empty")
        item = Item(item_id or ev.new_id("item"), "user", audio=bytes(self.buffer), rate=self.cfg.in_rate)
        self.buffer.clear()
        previous = self.conversation.add(item)
        self.conversation.forget_audio(self.settings.max_context_audio_s)
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
        item = self.conversation.item_from(e.item, self.cfg.in_rate)
        took = seconds(len(item.audio), self.cfg.in_rate)
        if took > self.settings.max_turn_audio_s or self.audio_in_s + took > self.settings.max_audio_s:
            raise ev.bad(
                "the item's audio is over the session's limits", "input_audio_too_long", "item.content"
            )
        self.audio_in_s += took
        previous = self.conversation.add(item, e.previous_item_id)
        self.conversation.forget_audio(self.settings.max_context_audio_s)
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

    @property
    def turns(self) -> int:
        return self.responses.turns

    @property
    def audio_out_s(self) -> float:
        return self.responses.audio_out_s


def _voice_activity(cfg: SessionConfig) -> VoiceActivity | None:
    """The session's speech detector, when it asked for server VAD (numpy and onnxruntime load with it)."""
    if cfg.vad is None:
        return None
    from gateway.realtime.vad import VoiceActivity, shared_model

    return VoiceActivity(shared_model(), cfg.vad)
