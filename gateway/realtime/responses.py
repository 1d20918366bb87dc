"""A realtime session's responses: one at a time, each a task of its own (so that speech or
``response.cancel`` can stop it mid-answer), counted against the session's budget of turns.

Starting one builds the turn's chat request and request context (gateway/realtime/turn.py); its task
renders the stream as response events; cancelling it closes the engine request before ``response.done``
(``cancelled``) goes out, and the interrupted answer stays in the conversation as far as it went.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import ValidationError

from core.capabilities import EngineFacts
from core.context import RequestContext
from core.errors import RateLimited
from gateway.realtime import events as ev
from gateway.realtime import turn as turns
from gateway.realtime.conversation import Conversation, Item, SessionConfig
from gateway.realtime_settings import RealtimeSettings
from observability.metrics import Metrics
from policies.media.targets import targets_from

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline
    from gateway.realtime.passthrough import Relay

log = structlog.get_logger("omnigate.realtime")


def engine_rate(pipeline: Pipeline, model: str) -> int | None:
    """The audio rate the model's engines take, as media-limits targets them (None: not known)."""
    facts = (
        EngineFacts(e.name, tuple(e.config.serves), e.config.role, e.capabilities)
        for e in pipeline.pool.engines.values()
    )
    target = targets_from(facts).get(model)
    return target.audio_rate if target is not None else None


class Responses:
    def __init__(
        self,
        pipeline: Pipeline,
        metrics: Metrics,
        settings: RealtimeSettings,
        ctx: RequestContext,
        session_id: str,
        emit: turns.Emit,
        conversation: Conversation,
        relay: Relay | None = None,
    ) -> None:
        self.relay = relay  # passthrough: the engine's own realtime socket; None: the pipeline
        self.pipeline, self.metrics, self.settings = pipeline, metrics, settings
        self.ctx, self.id, self.emit, self.conversation = ctx, session_id, emit, conversation
        self.turns = 0
        self.audio_out_s = 0.0
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._turn: turns.Turn | None = None

    @property
    def active(self) -> turns.Turn | None:
        """The response in progress, or None."""
        return self._turn if self._turn is not None and not self._turn.done else None

    async def start(self, cfg: SessionConfig, params: ev.ResponseParams | None) -> None:
        """Start a response to the conversation so far (refused while one is in progress)."""
        if self._turn is not None and not self._turn.done:
            raise ev.bad("a response is already in progress", "conversation_already_has_active_response")
        if self.turns >= self.settings.max_turns:
            raise ev.bad(
                f"the session's budget of {self.settings.max_turns} responses is spent",
                "session_turn_limit",
                fatal=True,
            )
        modalities: list[str] = list(
            params.output_modalities if params and params.output_modalities else cfg.modalities
        )
        limit = (
            params.max_output_tokens
            if params and params.max_output_tokens is not None
            else cfg.max_output_tokens
        )
        rate = None if self.relay is not None else engine_rate(self.pipeline, cfg.model)
        await self.conversation.resample(rate)
        try:
            chat = turns.chat_request(
                cfg,
                self.conversation,
                modalities,
                params.instructions if params else None,
                None if limit == "inf" else limit,
                self.settings.max_context_audio_s,
                rate,
            )
        except ValidationError as exc:
            raise ev.bad(
                f"the conversation cannot be answered: {exc.errors()[0]['msg']}", "conversation_empty"
            ) from None
        self.turns += 1
        turn = turns.Turn(self.turns, modalities, cfg.out_rate)
        last_user = next((i for i in reversed(self.conversation.items) if i.role == "user"), None)
        audio_in, rate = (last_user.audio, last_user.rate) if last_user is not None else (b"", cfg.in_rate)
        ctx = turns.turn_context(self.ctx, turn, self.id, audio_in, rate)
        self._turn = turn
        self._task = asyncio.get_running_loop().create_task(
            self._run(turn, ctx, chat, audio_in, rate), name=f"realtime-{self.id}"
        )

    async def _run(
        self, turn: turns.Turn, ctx: RequestContext, chat: Any, audio_in: bytes, rate: int
    ) -> None:
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
                if self.relay is not None:
                    status = await self.relay.run(ctx, turn, audio_in, rate, self.emit)
                else:
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
            if turn.error is not None and turn.error["code"] == RateLimited.code:
                # The tenant's quota, not the client's event: said as an error event too (a client backs off
                # on it), not counted against the session's budget of errors, and the session goes on.
                refused = ev.RealtimeError(
                    turn.error["message"], code=RateLimited.code, type_=RateLimited.type
                )
                await self.emit(refused.event(None))
            await self._finish(turn, status)
            if self.relay is not None and self.relay.broken:
                await self.relay.end_session()  # its engine is gone or silent: told, the session closes
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
        # In the conversation even when empty (cancelled or failed before its answer began): its item was
        # announced, so a client may truncate, retrieve or place after it; an empty one is no message to
        # the engine.
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
