"""Per-engine concurrency: slots, the bounded FIFO wait for one, and the lease a request holds.

A request claims a slot on an engine (:meth:`Slots.acquire`, :meth:`Slots.claim`) and gives it back
(:meth:`Slots.release`); the pipeline holds it as a :class:`Lease`, which settles it exactly once. An
engine's cap is the lowest of its configured ``max_in_flight`` (the seeds' ``max_num_seqs``, 8), its
``max_in_flight_overloaded`` (4) while the gateway is overloaded (see :mod:`gateway.admission`), and the
routing table's ``limits`` entry that the rollback controller's ``limit_concurrency`` action sets (its
``raise_concurrency`` replaces the configured cap by a higher one, ``raised``). When every available
engine for a request is at its cap, the request waits in a bounded FIFO queue per engine
(``max_waiting``, at most ``max_wait_s``) and a freed slot is handed straight to the oldest waiter, so
newcomers cannot overtake; a full queue or a wait that runs out is :class:`core.errors.EngineBusy`
(503 with ``Retry-After``). All of it runs on the event loop thread and needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import structlog

from core.errors import EngineBusy, EngineError
from engines.base import Engine
from engines.health import Health
from engines.routing import RoutingTable
from observability.metrics import Metrics

log = structlog.get_logger("engines.pool")

_BUSY_RETRY_AFTER_S = 1.0


class _Requeue(Exception):
    """A waiter woken without a slot: every engine it waited for became unavailable; look again."""


@dataclass(eq=False, slots=True)
class _Waiter:
    """One request waiting for a slot on any of ``engines``; the future resolves to the engine granted."""

    engines: tuple[str, ...]
    future: asyncio.Future[Engine]


class Lease:
    """One request's claimed slot on ``engine``, settled exactly once however the request goes.

    Used as ``async with lease:`` around one engine call. Leaving the block by an exception settles
    it: an :class:`~core.errors.EngineError` that allows failover first counts as a failure for the
    engine's circuit and then settles the slot as an outcome; any other error (a non-retryable engine
    error, cancellation, a bug) gives it back without one. Leaving it normally gives the slot back too,
    unless :meth:`keep` handed it on to the request, which then :meth:`settle`\\ s it when it ends or
    moves on to another engine. Settling twice is a no-op, so no path can release a slot twice.
    """

    __slots__ = ("_failed", "_held", "_kept", "_release", "engine")

    def __init__(self, engine: Engine, release: Callable[..., None], failed: Callable[[str], None]) -> None:
        self.engine = engine
        self._release = release
        self._failed = failed
        self._held = True
        self._kept = False

    @property
    def held(self) -> bool:
        return self._held

    def keep(self) -> None:
        """The engine call succeeded: the slot stays with the request past this block."""
        self._kept = True

    def settle(self, *, reported: bool) -> None:
        """Give the slot back, once. ``reported=False``: no outcome was reported (a half-open trial is
        given back to the circuit)."""
        if not self._held:
            return
        self._held = False
        self._release(self.engine, settled=reported)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Nothing of the exception is kept: its traceback holds the caller's frame (and its request).
        if exc is None:
            if not self._kept:
                self.settle(reported=False)
            return
        retryable = isinstance(exc, EngineError) and exc.retryable
        if retryable and self._held:
            self._failed(self.engine.name)
        self.settle(reported=retryable)


class Slots:
    def __init__(
        self,
        engines: dict[str, Engine],
        by_model: dict[str, list[Engine]],
        health: Health,
        metrics: Metrics,
        table: Callable[[], RoutingTable],
    ) -> None:
        self.engines = engines
        self._by_model = by_model
        self._health = health
        self._metrics = metrics
        self._table = table
        self.in_flight: dict[str, int] = {name: 0 for name in engines}
        self._waiters: dict[str, deque[_Waiter]] = {name: deque() for name in engines}
        #: configured caps per engine: (normal, while overloaded); None: no cap
        self._caps: dict[str, tuple[int | None, int | None]] = {
            e.name: (e.config.max_in_flight, e.config.overload_limit()) for e in engines.values()
        }
        #: set by the admission gate's overload loop: engines run at their max_in_flight_overloaded
        self.overloaded = False
        health.on_down = self.strand_check
        health.on_up = self.grow

    # -- read side ------------------------------------------------------------
    def limit(self, name: str) -> int | None:
        """The engine's concurrency cap now: the lowest of its configured cap (normal or overloaded) and the
        routing table's; None: no cap."""
        table = self._table()
        normal, overloaded = self._caps[name]
        raised = table.raised.get(name)
        if raised is not None and normal is not None:
            normal = max(normal, raised)  # the controller's raise_concurrency; overload still wins
        own = overloaded if self.overloaded else normal
        routed = table.limits.get(name)
        if own is None or routed is None:
            return routed if own is None else own
        return min(own, routed)

    def configured_cap(self, name: str) -> int | None:
        return self._caps[name][0]

    def waiting(self, name: str) -> int:
        return sum(1 for w in self._waiters[name] if not w.future.done())

    def full(self, name: str) -> bool:
        """At its cap, or others are already queued for it (a newcomer never overtakes the queue)."""
        limit = self.limit(name)
        return (limit is not None and self.in_flight[name] >= limit) or self._queued(name)

    def _queued(self, name: str) -> bool:
        q = self._waiters[name]
        while q and q[0].future.done():
            q.popleft()
        return bool(q)

    # -- claims -------------------------------------------------------------
    def acquire(self, engine: Engine) -> bool:
        """Claim one request's slot on ``engine`` now; False when it is at its cap or ejected."""
        name = engine.name
        if self.full(name) or not self._health.admit(engine, self._by_model):
            return False
        self.in_flight[name] += 1
        self.publish(name)
        self._metrics.engine_queue_wait.labels(name).observe(0.0)
        return True

    async def claim(self, engines: list[Engine], model: str | None = None) -> Engine | None:
        """A slot on the first of ``engines`` (in order) that has one; the engine, already claimed.

        Only available engines (healthy, circuit not open) take load that spills over from a full
        one. When every available engine is at its cap, wait boundedly for the first slot any of
        them frees. With no available engine at all, the others are tried as a last resort; None
        when none of them can be claimed either.
        """
        deadline: float | None = None
        up_now = self._health.up
        while True:
            up = [e for e in engines if up_now(e.name)]
            for e in up:
                if self.acquire(e):
                    return e
            full = [e for e in up if self.full(e.name)]
            if not full:
                for e in engines:
                    if e not in up and self.acquire(e):
                        return e
                return None
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + max(e.config.max_wait_s for e in full)
            try:
                return await self._wait(full, model, deadline)
            except _Requeue:
                continue

    async def _wait(self, full: list[Engine], model: str | None, deadline: float) -> Engine:
        queues = [e for e in full if e.config.max_wait_s > 0 and self.waiting(e.name) < e.config.max_waiting]
        if not queues:
            self._metrics.admission_shed.labels("engine_busy").inc()
            raise EngineBusy(
                f"every engine for {model!r} is at its concurrency limit", retry_after=_BUSY_RETRY_AFTER_S
            )
        waiter = _Waiter(tuple(e.name for e in queues), asyncio.get_running_loop().create_future())
        for e in queues:
            self._waiters[e.name].append(waiter)
            self.publish(e.name)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                granted = await waiter.future
        except BaseException as exc:  # cancellation included: a slot handed over meanwhile is passed on
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # A slot was handed over just as the wait ended: pass it on.
                self.release(waiter.future.result(), settled=False)
            else:
                waiter.future.cancel()
            if isinstance(exc, TimeoutError):
                self._metrics.admission_shed.labels("engine_busy").inc()
                raise EngineBusy(
                    f"no engine for {model!r} had a free slot within the wait limit",
                    retry_after=_BUSY_RETRY_AFTER_S,
                ) from None
            raise
        finally:
            for e in queues:
                with contextlib.suppress(ValueError):
                    self._waiters[e.name].remove(waiter)
                self.publish(e.name)
        self._metrics.engine_queue_wait.labels(granted.name).observe(time.perf_counter() - t0)
        return granted

    def release(self, engine: Engine | str, *, settled: bool = True) -> None:
        """End a claim. ``settled=False``: no outcome was reported (the half-open trial is given back).

        While the engine is within its cap, the slot goes straight to the oldest request waiting for it.
        """
        name = engine if isinstance(engine, str) else engine.name
        if name not in self.in_flight:
            return
        if not settled:
            self._health.give_back_trial(name)
        limit = self.limit(name)
        if not (limit is not None and self.in_flight[name] > limit) and self._hand_over(name):
            self.publish(name)
            return
        self.in_flight[name] = max(0, self.in_flight[name] - 1)
        self.publish(name)

    def _hand_over(self, name: str) -> bool:
        """Give one held slot of ``name`` to its oldest live waiter; False when nobody can take it."""
        q = self._waiters[name]
        engine = self.engines[name]
        while q:
            w = q[0]
            if w.future.done():
                q.popleft()
                continue
            if not self._health.admit(engine, self._by_model):
                return False
            q.popleft()
            w.future.set_result(engine)
            return True
        return False

    def grow(self, name: str) -> None:
        """The cap went up (or the engine came back): let waiters in while there is room."""
        limit = self.limit(name)
        while self._queued(name) and (limit is None or self.in_flight[name] < limit):
            self.in_flight[name] += 1
            if not self._hand_over(name):
                self.in_flight[name] -= 1
                break
        self.publish(name)

    def strand_check(self, name: str) -> None:
        """``name`` became unavailable: waiters with no available engine left look again (last resort)."""
        for w in list(self._waiters[name]):
            if not w.future.done() and not any(self._health.up(n) for n in w.engines):
                w.future.set_exception(_Requeue())

    def set_overloaded(self, overloaded: bool) -> None:
        """Switch every engine to its overload cap, or back (called by the admission gate's loop)."""
        if overloaded == self.overloaded:
            return
        self.overloaded = overloaded
        for name in self.engines:
            log.info(
                "engine_limit_changed",
                engine=name,
                limit=self.limit(name),
                overloaded=overloaded,
                in_flight=self.in_flight[name],
            )
            self.grow(name)

    def publish(self, name: str) -> None:
        m = self._metrics
        limit = self.limit(name)
        m.engine_in_flight.labels(name).set(self.in_flight[name])
        m.engine_waiting.labels(name).set(self.waiting(name))
        m.engine_limit.labels(name).set(-1 if limit is None else limit)
