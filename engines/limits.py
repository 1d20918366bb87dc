"""Per-engine concurrency: at most ``max_in_flight`` requests on an engine at once (fewer while overloaded).

The seeds run Qwen3-Omni with ``max_num_seqs`` 8, and 4 under overload; mirroring that in the gateway keeps a
slow engine from absorbing every admitted request, and keeps the requests it cannot take yet where the
gateway can still move them. A request asks for a slot on any of its candidate engines, in preference order:

* the first candidate with a free slot (and nobody already waiting for it) is taken at once, so a request
  spills over to the next engine when the preferred one is full;
* when every candidate is full, the request waits in each candidate's FIFO queue that has room (at most
  ``max_waiting`` per engine) and takes the first slot any of them frees, handed over in arrival order;
* when no queue has room, or the wait passes ``max_wait_s`` (the longest of its engines'), it fails with
  :class:`gateway.errors.EngineBusy` (503 with ``Retry-After``) and nothing reaches an engine.

Every waiter also holds an admission slot, so the queues are bounded twice over. Everything here runs on
the event loop thread and needs no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import structlog

from gateway.errors import EngineBusy

if TYPE_CHECKING:
    from engines.base import Engine
    from observability.metrics import Metrics

log = structlog.get_logger(__name__)

_BUSY_RETRY_AFTER_S = 1.0


@dataclass(eq=False, slots=True)
class _Waiter:
    future: asyncio.Future["EngineLimiter"]


@dataclass(eq=False, slots=True)
class EngineLimiter:
    """The slots of one engine."""

    engine: "Engine"
    base_limit: int | None
    overload_limit: int | None
    max_waiting: int
    max_wait_s: float
    limit: int | None = None
    in_flight: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.limit = self.base_limit

    @property
    def name(self) -> str:
        return self.engine.name

    def has_room(self) -> bool:
        return self.limit is None or self.in_flight < self.limit

    def has_waiters(self) -> bool:
        while self.waiters and self.waiters[0].future.done():
            self.waiters.popleft()
        return bool(self.waiters)


@dataclass(eq=False, slots=True)
class EngineSlot:
    """One request's slot on one engine; :meth:`release` is idempotent."""

    limiter: EngineLimiter
    slots: "EngineSlots"
    released: bool = False

    @property
    def engine(self) -> "Engine":
        return self.limiter.engine

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots._release(self.limiter)


class EngineSlots:
    """The per-engine limiters of one pool, and the overload switch that lowers them."""

    def __init__(self, engines: Iterable["Engine"], metrics: "Metrics") -> None:
        self._metrics = metrics
        self._limiters: dict[str, EngineLimiter] = {}
        self.overloaded = False
        for e in engines:
            cfg = e.config
            lim = EngineLimiter(
                engine=e,
                base_limit=cfg.max_in_flight,
                overload_limit=cfg.overload_limit(),
                max_waiting=cfg.max_waiting,
                max_wait_s=cfg.max_wait_s,
            )
            self._limiters[e.name] = lim
            self._publish(lim)

    def limiter(self, name: str) -> EngineLimiter:
        return self._limiters[name]

    # -- the request path ------------------------------------------------------
    async def acquire(self, engines: list["Engine"], model: str | None = None) -> EngineSlot:
        """A slot on the first of ``engines`` that has one, waiting boundedly when all are full."""
        limiters = [self._limiters[e.name] for e in engines]
        for lim in limiters:
            if lim.has_room() and not lim.has_waiters():
                return self._grant(lim)
        queues = [lim for lim in limiters if len(lim.waiters) < lim.max_waiting and lim.max_wait_s > 0]
        if not queues:
            self._metrics.engine_busy.labels(model or "unknown").inc()
            raise EngineBusy(
                f"every engine for {model!r} is at its concurrency limit", retry_after=_BUSY_RETRY_AFTER_S
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        for lim in queues:
            lim.waiters.append(waiter)
            self._publish(lim)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(max(lim.max_wait_s for lim in queues)):
                granted = await waiter.future
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # A slot was handed over just as the wait ended: pass it on.
                self._release(waiter.future.result())
            else:
                waiter.future.cancel()
            if isinstance(exc, TimeoutError):
                self._metrics.engine_busy.labels(model or "unknown").inc()
                raise EngineBusy(
                    f"no engine for {model!r} had a free slot within the wait limit",
                    retry_after=_BUSY_RETRY_AFTER_S,
                ) from None
            raise
        finally:
            for lim in queues:
                try:
                    lim.waiters.remove(waiter)
                except ValueError:
                    pass
                self._publish(lim)
        self._metrics.engine_queue_wait.labels(granted.name).observe(time.perf_counter() - t0)
        return EngineSlot(granted, self)

    def _grant(self, lim: EngineLimiter) -> EngineSlot:
        lim.in_flight += 1
        self._publish(lim)
        self._metrics.engine_queue_wait.labels(lim.name).observe(0.0)
        return EngineSlot(lim, self)

    def _release(self, lim: EngineLimiter) -> None:
        # Hand the slot straight to the oldest live waiter while the engine is within its limit,
        # so a newcomer cannot overtake the queue.
        if lim.limit is None or lim.in_flight <= lim.limit:
            while lim.waiters:
                waiter = lim.waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_result(lim)
                    self._publish(lim)
                    return
        lim.in_flight -= 1
        self._publish(lim)

    # -- control (off the request path) ---------------------------------------
    def set_overloaded(self, overloaded: bool) -> None:
        """Switch every engine to its overload limit, or back."""
        if overloaded == self.overloaded:
            return
        self.overloaded = overloaded
        for lim in self._limiters.values():
            self.set_limit(lim.name, lim.overload_limit if overloaded else lim.base_limit)

    def set_limit(self, name: str, limit: int | None) -> None:
        """Change one engine's limit now; a lower limit lets running requests finish, a higher one wakes waiters."""
        lim = self._limiters[name]
        if limit == lim.limit:
            return
        log.info("engine_limit_changed", engine=name, limit=limit, previous=lim.limit, in_flight=lim.in_flight)
        lim.limit = limit
        while lim.waiters and lim.has_room():
            waiter = lim.waiters.popleft()
            if not waiter.future.done():
                lim.in_flight += 1
                waiter.future.set_result(lim)
        self._publish(lim)

    def snapshot(self) -> dict[str, dict[str, int | None]]:
        return {
            name: {"in_flight": lim.in_flight, "limit": lim.limit, "waiting": sum(1 for w in lim.waiters
                                                                                 if not w.future.done())}
            for name, lim in self._limiters.items()
        }

    def _publish(self, lim: EngineLimiter) -> None:
        m = self._metrics
        m.engine_in_flight.labels(lim.name).set(lim.in_flight)
        m.engine_waiting.labels(lim.name).set(sum(1 for w in lim.waiters if not w.future.done()))
        m.engine_limit.labels(lim.name).set(-1 if lim.limit is None else lim.limit)
