"""Per-engine concurrency: slots, the bounded FIFO wait for one, and the lease a request holds.

A request claims a slot on an engine (:meth:`Slots.acquire`, :meth:`Slots.claim`) and gives it back
(:meth:`Slots.release`); the pipeline holds it as a :class:`Lease`, which settles it exactly once. An
engine's cap is the lowest of its configured ``max_in_flight`` (the seeds' ``max_num_seqs``, 8), its
``max_in_flight_overloaded`` (4) while the gateway is overloaded (see :mod:`gateway.admission`), and the
routing table's ``limits`` entry that the rollback controller's ``limit_concurrency`` action sets (its
``raise_concurrency`` replaces the configured cap by a higher one, ``raised``): all of it read from the
pool's current :class:`~engines.selection.view.View` (:meth:`View.limit`), once per claim. When every
available engine for a request is at its cap, the request waits in a bounded FIFO queue per engine, where a
freed slot goes straight to the oldest waiter and a new view lets waiters in where the cap rose: that wait is
:class:`~engines.selection.slot_wait.SlotWait` (engines/selection/slot_wait.py), which :class:`Slots`
extends over the same per-engine counts and queues. All of it runs on the event loop thread, without locks.

With Redis configured the caps hold across replicas: every slot a replica grants is also a lease in
Redis, taken only while the engine holds fewer than its cap on every replica together
(:class:`~engines.selection.shared_caps.SharedCaps`, engines/selection/shared_caps.py, over the lease
protocol of :mod:`core.leases`). A slot handed to a waiter keeps its lease. An engine full on other
replicas is tried again after a short pause until the wait limit (no FIFO across replicas). Redis
unreachable: each replica fails open to a share of each cap (``traffic.fail_open_share``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from core.errors import EngineError
from engines.adapters.base import Engine
from engines.selection.health import Health
from engines.selection.shared_caps import REFUSED, SharedCaps
from engines.selection.slot_wait import SlotWait, _Requeue, _Waiter
from engines.selection.view import View, Views
from observability.metrics import Children, Metrics

#: how long an engine found full on the other replicas is passed over, and how often a request holding a
#: local slot on it asks Redis again
_SHARED_RETRY_S = 0.05


class Lease:
    """One request's claimed slot on ``engine``, settled exactly once however the request goes.

    Used as ``async with lease:`` around one engine call. Leaving the block by an exception settles
    it: an :class:`~core.errors.EngineError` that allows failover first counts as a failure for the
    engine's circuit and then settles the slot as an outcome; any other error (a non-retryable engine
    error, cancellation, a bug) gives it back without one. Leaving it normally gives the slot back too,
    unless :meth:`keep` handed it on to the request, which then :meth:`settle`\\ s it when it ends or
    moves on to another engine. Settling twice is a no-op, so no path can release a slot twice.
    """

    __slots__ = ("_failed", "_held", "_kept", "_release", "engine", "shared")

    def __init__(
        self,
        engine: Engine,
        release: Callable[..., None],
        failed: Callable[[str], None],
        shared: str | None = None,
    ) -> None:
        self.engine = engine
        #: the slot's lease in Redis (:class:`SharedCaps`), when the caps are shared
        self.shared = shared
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
        if self.shared is None:
            self._release(self.engine, settled=reported)
        else:
            self._release(self.engine, settled=reported, shared=self.shared)

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


class Slots(SlotWait):
    def __init__(
        self,
        engines: dict[str, Engine],
        by_model: dict[str, list[Engine]],
        health: Health,
        metrics: Metrics,
        views: Views,
    ) -> None:
        self.engines = engines
        self._by_model = by_model
        self._health = health
        self._metrics = metrics
        self._in_flight_gauge = Children(metrics.engine_in_flight)
        self._waiting_gauge = Children(metrics.engine_waiting)
        self._limit_gauge = Children(metrics.engine_limit)
        self._views = views
        self.in_flight: dict[str, int] = {name: 0 for name in engines}
        self._waiters: dict[str, deque[_Waiter]] = {name: deque() for name in engines}
        #: configured caps per engine: (normal, while overloaded); None: no cap
        self._caps: dict[str, tuple[int | None, int | None]] = {
            e.name: (e.config.max_in_flight, e.config.overload_limit()) for e in engines.values()
        }
        #: the caps shared with the other replicas through Redis; None: this process's own
        self.shared: SharedCaps | None = None
        #: engine -> monotonic time until which it is passed over (full on the other replicas)
        self._shared_busy: dict[str, float] = {}

    # -- read side ------------------------------------------------------------
    def limit(self, name: str, view: View | None = None) -> int | None:
        """The engine's concurrency cap under ``view`` (None: the current one; see :meth:`View.limit`)."""
        shared = self.shared
        fail_open = shared.fail_open_cap if shared is not None and shared.up is False else None
        return (view or self._views.current).limit(name, *self._caps[name], fail_open)

    def configured_cap(self, name: str) -> int | None:
        return self._caps[name][0]

    def waiting(self, name: str) -> int:
        return sum(1 for w in self._waiters[name] if not w.future.done())

    def full(self, name: str, view: View | None = None) -> bool:
        """At its cap, or others are already queued for it (a newcomer never overtakes the queue)."""
        limit = self.limit(name, view)
        if limit is not None and self.in_flight[name] >= limit:
            return True
        return self._queued(name) or self._shared_busy.get(name, 0.0) > time.monotonic()

    def _queued(self, name: str) -> bool:
        q = self._waiters[name]
        while q and q[0].future.done():
            q.popleft()
        return bool(q)

    # -- claims -------------------------------------------------------------
    def acquire(self, engine: Engine, view: View | None = None) -> bool:
        """Claim one request's slot on ``engine`` now; False when it is at its cap or ejected."""
        name = engine.name
        if self.full(name, view) or not self._health.admit(engine, self._by_model):
            return False
        self.in_flight[name] += 1
        self.gauges(name)
        self._metrics.engine_queue_wait.labels(name).observe(0.0)
        return True

    async def claim(
        self, engines: list[Engine], model: str | None = None, view: View | None = None
    ) -> Engine | None:
        """:meth:`claim_slot` without its shared lease (which, with shared caps, is then released only
        when this task ends: requests hold a :class:`Lease` instead)."""
        got = await self.claim_slot(engines, model, view)
        return None if got is None else got[0]

    async def claim_slot(
        self, engines: list[Engine], model: str | None = None, view: View | None = None
    ) -> tuple[Engine, str | None] | None:
        """:meth:`_claim_local`, and with shared caps the slot's lease in Redis: the engine and the lease.

        The caps are ``view``'s (None: the current view, read once); a request that waits reads the newest.
        An engine full on the other replicas is passed over for a moment when another of ``engines`` has
        room; otherwise the request keeps its local slot (its place in this replica's queue) and asks
        Redis again every few tens of milliseconds until the engine's wait limit, then 503 engine_busy.
        """
        shared = self.shared
        started = time.monotonic()
        view = self._views.current if view is None else view
        while True:
            got = await self._claim_local(engines, model, view)
            if got is None or shared is None:
                return got
            engine, lease = got
            if lease is not None:
                shared.own(lease)
                return got
            limit = self.limit(engine.name, view)
            if limit is None:
                return got
            deadline = started + engine.config.max_wait_s
            try:
                while True:
                    result, lease = await shared.take(engine.name, limit)
                    if result != REFUSED:
                        return engine, lease
                    self._shared_busy[engine.name] = time.monotonic() + _SHARED_RETRY_S
                    if time.monotonic() + _SHARED_RETRY_S > deadline:
                        raise self._busy(model)
                    if any(
                        e is not engine and self._health.up(e.name) and not self.full(e.name) for e in engines
                    ):
                        break  # another engine has room: this slot goes back, the claim looks again
                    await asyncio.sleep(_SHARED_RETRY_S)
                    limit = self.limit(engine.name) or limit
            except BaseException:
                self.release(engine, settled=False)
                raise
            self.release(engine, settled=False)
            view = self._views.current  # looking again after a pause: the newest view

    async def _claim_local(
        self, engines: list[Engine], model: str | None, view: View
    ) -> tuple[Engine, str | None] | None:
        """A slot on the first of ``engines`` (in order) that has one; the engine, already claimed.

        Only available engines (healthy, circuit not open) take load that spills over from a full
        one. When every available engine is at its cap, wait boundedly for the first slot any of
        them frees. With no available engine at all, the others are tried as a last resort; None
        when none of them can be claimed either. A look after a wait reads the newest view.
        """
        deadline: float | None = None
        up_now = self._health.up
        while True:
            up = [e for e in engines if up_now(e.name)]
            for e in up:
                if self.acquire(e, view):
                    return e, None
            full = [e for e in up if self.full(e.name, view)]
            if not full:
                for e in engines:
                    if e not in up and self.acquire(e, view):
                        return e, None
                return None
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + max(e.config.max_wait_s for e in full)
            try:
                return await self._wait(full, model, deadline)
            except _Requeue:
                view = self._views.current
                continue

    def release(self, engine: Engine | str, *, settled: bool = True, shared: str | None = None) -> None:
        """End a claim. ``settled=False``: no outcome was reported (the half-open trial is given back).

        While the engine is within its cap, the slot goes straight to the oldest request waiting for it,
        with its lease in Redis (``shared``); otherwise the lease is given back.
        """
        name = engine if isinstance(engine, str) else engine.name
        if name not in self.in_flight:
            return
        if not settled:
            self._health.give_back_trial(name)
        limit = self.limit(name)
        if not (limit is not None and self.in_flight[name] > limit) and self._hand_over(name, shared):
            self.gauges(name)
            return
        self.in_flight[name] = max(0, self.in_flight[name] - 1)
        if shared is not None and self.shared is not None:
            self.shared.give_back(shared)
        self.gauges(name)

    def _hand_over(self, name: str, lease: str | None = None) -> bool:
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
            if lease is not None and self.shared is not None:
                self.shared.passing(lease)
            w.future.set_result((engine, lease))
            return True
        return False

    def gauges(self, name: str) -> None:
        """Show the engine's in-flight count, queue and cap in the metrics."""
        limit = self.limit(name)
        self._in_flight_gauge(name).set(self.in_flight[name])
        self._waiting_gauge(name).set(self.waiting(name))
        self._limit_gauge(name).set(-1 if limit is None else limit)
