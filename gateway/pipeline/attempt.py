"""The one attempt loop: engine choice, then failover until an engine answers.

Both paths call it: the stream path's call ends at the engine's first chunk (the failover point), the
JSON path's at its whole answer. Each try takes a lease on the first engine left that has a free slot
(waiting boundedly when all are at their cap, see :mod:`engines.selection.slots`); the lease settles that slot
in its ``__aexit__`` when the call fails, and is handed to the request (``ctx.lease``) when it succeeds.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from core.context import RequestContext
from core.errors import EngineError, EngineProtocolError, EngineUnavailable
from core.events import Delta
from core.schemas import ChatCompletionRequest
from engines.adapters.base import Engine
from engines.selection import choice
from engines.selection.pool import EnginePool
from engines.selection.view import View
from observability.metrics import Metrics

log = structlog.get_logger("omnigate.request")

T = TypeVar("T")


@dataclass(slots=True)
class Attempt:
    """One engine call that produced a first chunk (the commit point)."""

    engine: Engine
    request: ChatCompletionRequest
    upstream: AsyncGenerator[Delta, None]
    first: Delta
    #: perf_counter() when the engine request was sent (0: not one engine call, e.g. joined segments)
    sent: float = 0.0


@dataclass(slots=True)
class Answered(Generic[T]):
    """What one successful engine call gave: the engine, the request as fitted to it, its result."""

    engine: Engine
    request: ChatCompletionRequest
    result: T
    #: perf_counter() when the engine request was sent
    sent: float


async def first_chunk(
    engine: Engine, request: ChatCompletionRequest
) -> tuple[AsyncGenerator[Delta, None], Delta]:
    """The stream path's engine call: open the stream and read up to its first chunk."""
    upstream = engine.stream(request)
    try:
        first = await anext(upstream)
    except StopAsyncIteration:
        await upstream.aclose()
        raise EngineProtocolError(f"engine {engine.name} sent an empty stream", engine=engine.name) from None
    except EngineError:
        await upstream.aclose()
        raise
    return upstream, first


class Attempts:
    """Engine choice and failover for one request at a time (it keeps nothing of a request)."""

    def __init__(self, pool: EnginePool, metrics: Metrics) -> None:
        self.pool = pool
        self.metrics = metrics

    async def call(
        self,
        request: ChatCompletionRequest,
        ctx: RequestContext,
        call: Callable[[Engine, ChatCompletionRequest], Awaitable[T]],
    ) -> Answered[T]:
        """Try the request's engines in order until ``call`` succeeds on one; its lease goes to ``ctx``.

        An engine error that allows failover moves on to the next engine; any other error ends the loop.
        """
        view = self.pool.view  # the one view of the routing and caps this request's engine choice reads
        engines = self.engines_for(request, view)
        last: EngineError | None = None
        try:
            while engines:
                lease = await self.pool.lease(engines, request.model, view)
                if lease is None:
                    break
                engine = lease.engine
                engines = [e for e in engines if e is not engine]
                try:
                    async with lease:
                        adapted = self.adapt(engine, request, ctx)
                        if adapted is None:
                            continue  # the lease gives the slot back: no call was made
                        ctx.record.attempts += 1
                        if ctx.trace is not None:  # its span context goes to the engine with the call
                            ctx.trace.attempt(
                                engine.name, engine.config.variant, engine.config.model, engine.config.kind
                            )
                        sent = time.perf_counter()
                        result = await call(engine, adapted)
                        lease.keep()
                except EngineError as exc:
                    last = exc
                    if ctx.trace is not None:
                        ctx.trace.attempt_failed(exc)
                    self._failed(engine, exc, more=bool(engines))
                    if not exc.retryable:
                        raise
                    continue
                ctx.record.engine, ctx.record.variant = engine.name, engine.config.variant
                ctx.lease = lease
                return Answered(engine, adapted, result, sent)
            raise last or self.no_engine(request)
        finally:
            # An engine error's traceback holds this frame, whose ``last`` holds the error: a cycle that
            # would keep the request (its media) alive until the next full collection.
            last = None

    def unbind(self, ctx: RequestContext) -> None:
        """Give back the engine slot of an attempt being replaced (post-policy retry, next segment)."""
        lease, ctx.lease = ctx.lease, None
        if lease is not None:
            lease.settle(reported=False)
        ctx.record.engine = None

    def engines_for(self, request: ChatCompletionRequest, view: View | None = None) -> list[Engine]:
        engines = self.pool.candidates(request.model, view)
        if not engines:
            raise self.no_engine(request)  # every engine of the model serves other weights than configured
        return choice.able(engines, request)

    @staticmethod
    def adapt(
        engine: Engine, request: ChatCompletionRequest, ctx: RequestContext
    ) -> ChatCompletionRequest | None:
        """Fit the request to what the engine can do; None when it cannot serve it at all."""
        fitted, degraded = choice.fit(engine, request)
        for reason in degraded:
            ctx.outputs.degrade(reason)
        return fitted

    def _failed(self, engine: Engine, exc: EngineError, more: bool) -> None:
        # The lease has already counted a failover-worthy error against the engine's circuit.
        self.metrics.engine_errors.labels(engine.name, exc.kind).inc()
        log.warning(
            "engine_attempt_failed",
            engine=engine.name,
            kind=exc.kind,
            error=exc.detail,
            failover=exc.retryable and more,
        )
        if exc.retryable and more:
            self.metrics.failovers.labels(engine.name).inc()

    @staticmethod
    def no_engine(request: ChatCompletionRequest) -> EngineError:
        # Engines at their cap are waited for (or refused with engine_busy) by pool.claim; here none
        # could be claimed at all (e.g. half-open with its trials taken, the others unavailable).
        return EngineUnavailable(f"no engine can serve {request.model!r} now")
