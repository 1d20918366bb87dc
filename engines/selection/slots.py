"""Per-engine concurrency: slots, the bounded FIFO wait for one, and the lease a request holds.

A request claims a slot on an engine (:meth:`Slots.acquire`, :meth:`Slots.claim`) and gives it back
(:meth:`Slots.release`); the pipeline holds it as a :class:`Lease`, which settles it exactly once. An
engine's cap is the lowest of its configured ``max_in_flight`` (the seeds' ``max_num_seqs``, 8), its
``max_in_flight_overloaded`` (4) while the gateway is overloaded (see :mod:`gateway.admission`), and the
routing table's ``limits`` entry that the rollback controller's ``limit_concurrency`` action sets (its
``raise_concurrency`` replaces the configured cap by a higher one, ``raised``): all of it read from the
pool's current :class:`~engines.selection.view.View` (:meth:`View.limit`), once per claim. A request
waiting for a slot also wakes on the next view and lets waiters in where the cap rose. When every available
engine for a request is at its cap, the request waits in a bounded FIFO queue per engine
(``max_waiting``, at most ``max_wait_s``) and a freed slot is handed straight to the oldest waiter, so
newcomers cannot overtake; a full queue or a wait that runs out is :class:`core.errors.EngineBusy`
(503 with ``Retry-After``). All of it runs on the event loop thread and needs no locks.

With Redis configured the caps hold across replicas (:class:`SharedCaps`): every slot a replica grants
is also a lease in Redis, in a sorted set per engine scored by its expiry (Redis's own clock), taken by
a Lua script only while the engine holds fewer than its cap, so the engine never has more requests in
flight than its cap however many replicas send to it. A slot handed to a waiter keeps its lease; a
lease is renewed by a heartbeat only while the request holding it lives (one whose request ended
without giving it back is given back and logged, ``engine_lease_leaked``), and a killed replica's
leases expire after ``traffic.lease_ttl_s``. An engine full on other replicas is tried again after a
short pause until the wait limit (no FIFO across replicas). Redis unreachable: as admission does, each
replica fails open to a share of each cap (``traffic.fail_open_share``), loudly, and probes Redis until
it answers.

Its length: the local slots and their leases in Redis are one count (a slot handed over keeps its lease,
a cap lowered or raised applies to both), kept side by side so the two cannot drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import structlog

from core.errors import EngineBusy, EngineError
from engines.adapters.base import Engine
from engines.selection.health import Health
from engines.selection.view import View, Views
from observability.metrics import Children, Metrics

log = structlog.get_logger("engines.pool")

_BUSY_RETRY_AFTER_S = 1.0
#: how long an engine found full on the other replicas is passed over, and how often a request holding a
#: local slot on it asks Redis again
_SHARED_RETRY_S = 0.05


class _Requeue(Exception):
    """A waiter woken without a slot: every engine it waited for became unavailable; look again."""


@dataclass(eq=False, slots=True)
class _Waiter:
    """One request waiting for a slot on any of ``engines``; the future resolves to the engine granted
    and the shared lease that comes with a slot handed over (None: the slot is new, or not shared)."""

    engines: tuple[str, ...]
    future: asyncio.Future[tuple[Engine, str | None]]


# -- caps shared through Redis ---------------------------------------------------------------------------
# One sorted set per engine: lease id -> expiry in ms of the Redis server's clock (TIME), so replicas'
# clocks never matter; expired members are removed before every count.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] the engine's leases; ARGV ttl ms, cap, lease id -> 1 taken | 0 the engine is at its cap
_TAKE_LUA = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
)
# KEYS[1] the engine's leases; ARGV lease ids -> removed
_GIVE_BACK_LUA = """
local removed = 0
for i = 1, #ARGV do removed = removed + redis.call('ZREM', KEYS[1], ARGV[i]) end
return removed
"""
# KEYS[1] the engine's leases; ARGV ttl ms, lease ids -> the ids no longer there (not brought back)
_RENEW_LUA = (
    _NOW
    + """
local exp = now + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', exp, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return lost
"""
)
# KEYS[1] the engine's leases -> live leases
_COUNT_LUA = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)

TAKEN, REFUSED, DOWN = "taken", "refused", "down"


class SharedCaps:
    """Engine slots as leases in Redis, shared by every replica (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        metrics: Metrics,
        *,
        key_prefix: str,
        lease_ttl_s: float,
        heartbeat_s: float,
        timeout_s: float,
        probe_s: float,
        fail_open_share: float,
        replica_id: str | None = None,
    ) -> None:
        """``client``: a ``redis.asyncio.Redis`` over the gateway's shared pool (closed here, not the pool)."""
        self.client = client
        self._metrics = metrics
        self._prefix = key_prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self.lease_ttl_s = lease_ttl_s
        self._heartbeat_s = heartbeat_s
        self._timeout_s = timeout_s
        self._probe_s = probe_s
        self.fail_open_share = fail_open_share
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._take = client.register_script(_TAKE_LUA)
        self._give = client.register_script(_GIVE_BACK_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._count = client.register_script(_COUNT_LUA)
        #: lease id -> engine name, for every lease this replica holds
        self.held: dict[str, str] = {}
        #: lease id -> the task of the request holding it (None while it passes to a waiter)
        self.owners: dict[str, asyncio.Task[Any] | None] = {}
        self.up: bool | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False

    def key(self, engine: str) -> str:
        return f"{{{self._prefix}}}:engine:{engine}"

    def fail_open_cap(self, cap: int) -> int:
        """The share of ``cap`` one replica applies alone while Redis is unreachable (never below 1)."""
        return max(1, math.floor(cap * self.fail_open_share))

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._probe()
        self._loop_task = asyncio.create_task(self._maintain(), name="engine-lease-heartbeat")

    async def aclose(self) -> None:
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task}, timeout=self._timeout_s * 4 + 1)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.held:  # requests still open at shutdown: their slots go back now, not after the TTL
            await self._give_back(list(self.held.items()))
        self.held.clear()
        self.owners.clear()
        await self.client.aclose()

    # -- the request path ------------------------------------------------------------------------------
    async def take(self, engine: str, cap: int) -> tuple[str, str | None]:
        """One lease on ``engine`` if it holds fewer than ``cap`` on every replica together:
        (TAKEN, lease id), (REFUSED, None), or (DOWN, None) when Redis cannot say (fail open)."""
        if not self.up:
            return DOWN, None
        lease = f"{self.replica_id}:{next(self._ids)}"
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                ok = await self._take(keys=[self.key(engine)], args=[self._ttl_ms, cap, lease])
        except asyncio.CancelledError:
            # The script may have run: give the lease back (a no-op if it was not taken).
            self._spawn(self._give_back([(lease, engine)]))
            raise
        except Exception as exc:  # redis errors, OSError, timeouts: all mean "unreachable" here
            self._spawn(self._give_back([(lease, engine)]))
            self._mark_down("engine_acquire", exc)
            return DOWN, None
        if not ok:
            return REFUSED, None
        self.held[lease] = engine
        self.owners[lease] = asyncio.current_task()
        return TAKEN, lease

    def own(self, lease: str) -> None:
        """The current task holds ``lease`` now (a slot handed over from another request)."""
        if lease in self.held:
            self.owners[lease] = asyncio.current_task()

    def passing(self, lease: str) -> None:
        """``lease`` goes to a waiter with its slot: nobody's until the waiter resumes."""
        if lease in self.held:
            self.owners[lease] = None

    def give_back(self, lease: str) -> None:
        engine = self.held.pop(lease, None)
        self.owners.pop(lease, None)
        if engine is not None:
            self._spawn(self._give_back([(lease, engine)]))

    async def in_flight(self, engine: str) -> int | None:
        """Leases on ``engine`` across every replica; None when Redis cannot say."""
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                return int(await self._count(keys=[self.key(engine)]))
        except Exception:
            return None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _give_back(self, leases: list[tuple[str, str]]) -> None:
        by_engine: dict[str, list[str]] = {}
        for lease, engine in leases:
            by_engine.setdefault(engine, []).append(lease)
        for engine, ids in by_engine.items():
            try:
                async with asyncio.timeout(self._timeout_s * 2):
                    await self._give(keys=[self.key(engine)], args=ids)
            except Exception as exc:
                # Nothing renews them any more: they expire by themselves after lease_ttl_s.
                self._metrics.traffic_store_errors.labels("engine_release").inc()
                log.warning("engine_lease_release_failed", engine=engine, leases=len(ids), error=repr(exc))

    # -- health and renewal (off the request path) --------------------------------------------------------
    def _mark_down(self, op: str, exc: BaseException) -> None:
        self._metrics.traffic_store_errors.labels(op).inc()
        if self.up is not False:
            self.up = False
            log.error(
                "engine_caps_store_unreachable",
                op=op,
                error=repr(exc),
                action="failing open to a share of each engine's cap",
                fail_open_share=self.fail_open_share,
            )

    async def _probe(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                await self.client.ping()
        except Exception as exc:
            self._mark_down("engine_ping", exc)
        else:
            if self.up is False:
                log.warning("engine_caps_store_recovered", action="sharing engine caps through Redis again")
            self.up = True

    async def _maintain(self) -> None:
        tick = min(self._heartbeat_s, self._probe_s)
        next_renew = time.monotonic() + self._heartbeat_s
        while not self._closing:
            await asyncio.sleep(tick)
            try:
                if not self.up:
                    await self._probe()
                elif time.monotonic() >= next_renew:
                    await self.renew_all()
                    next_renew = time.monotonic() + self._heartbeat_s
            except Exception as exc:  # the loop must outlive any one bad step
                log.warning("engine_lease_heartbeat_failed", error=repr(exc))

    async def renew_all(self) -> None:
        """Renew the leases whose request lives; give back those whose request ended without them."""
        leaked = [lease for lease, owner in self.owners.items() if owner is not None and owner.done()]
        if leaked:
            log.error("engine_lease_leaked", leases=leaked)
            gone = [(lease, self.held.pop(lease)) for lease in leaked if lease in self.held]
            for lease in leaked:
                self.owners.pop(lease, None)
            await self._give_back(gone)
        by_engine: dict[str, list[str]] = {}
        for lease, engine in self.held.items():
            by_engine.setdefault(engine, []).append(lease)
        for engine, ids in by_engine.items():
            try:
                async with asyncio.timeout(self._timeout_s * 4):
                    lost = await self._renew(keys=[self.key(engine)], args=[self._ttl_ms, *ids])
            except Exception as exc:
                self._mark_down("engine_renew", exc)
                return
            for raw in lost:
                lease = raw.decode() if isinstance(raw, bytes) else str(raw)
                if self.held.pop(lease, None) is not None:
                    self.owners.pop(lease, None)
                    log.warning(
                        "engine_lease_lost",
                        engine=engine,
                        lease=lease,
                        reason="expired in Redis before renewal; the request runs on uncounted",
                    )


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


class Slots:
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
                        self._metrics.admission_shed.labels("engine_busy").inc()
                        raise EngineBusy(
                            f"no engine for {model!r} had a free slot within the wait limit",
                            retry_after=_BUSY_RETRY_AFTER_S,
                        )
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

    async def _wait(
        self, full: list[Engine], model: str | None, deadline: float
    ) -> tuple[Engine, str | None]:
        queues = [e for e in full if e.config.max_wait_s > 0 and self.waiting(e.name) < e.config.max_waiting]
        if not queues:
            self._metrics.admission_shed.labels("engine_busy").inc()
            raise EngineBusy(
                f"every engine for {model!r} is at its concurrency limit", retry_after=_BUSY_RETRY_AFTER_S
            )
        waiter = _Waiter(tuple(e.name for e in queues), asyncio.get_running_loop().create_future())
        for e in queues:
            self._waiters[e.name].append(waiter)
            self.gauges(e.name)
        t0 = time.perf_counter()
        # An engine passed over for being full on the other replicas is looked at again when that ends.
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        busy = [t for e in queues if (t := self._shared_busy.get(e.name, 0.0)) > now]
        recheck = min(busy) - now + loop.time() if busy else None
        until = deadline if recheck is None or recheck >= deadline else max(recheck, loop.time())
        try:
            async with asyncio.timeout_at(until):
                while not waiter.future.done():
                    woken = (waiter.future, self._views.published())
                    await asyncio.wait(woken, return_when=asyncio.FIRST_COMPLETED)
                    if not waiter.future.done():  # a new view: where the cap rose, waiters go in
                        for name in waiter.engines:
                            self.grow(name)
                granted = waiter.future.result()
        except BaseException as exc:  # cancellation included: a slot handed over meanwhile is passed on
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # A slot was handed over just as the wait ended: pass it on.
                engine, lease = waiter.future.result()
                self.release(engine, settled=False, shared=lease)
            else:
                waiter.future.cancel()
            if isinstance(exc, TimeoutError) and until < deadline:
                raise _Requeue() from None
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
                self.gauges(e.name)
        self._metrics.engine_queue_wait.labels(granted[0].name).observe(time.perf_counter() - t0)
        return granted

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

    def grow(self, name: str) -> None:
        """The cap went up (or the engine came back): let waiters in while there is room."""
        limit = self.limit(name)
        while self._queued(name) and (limit is None or self.in_flight[name] < limit):
            self.in_flight[name] += 1
            if not self._hand_over(name):
                self.in_flight[name] -= 1
                break
        self.gauges(name)

    def strand_check(self, name: str) -> None:
        """``name`` became unavailable: waiters with no available engine left look again (last resort)."""
        for w in list(self._waiters[name]):
            if not w.future.done() and not any(self._health.up(n) for n in w.engines):
                w.future.set_exception(_Requeue())

    def gauges(self, name: str) -> None:
        """Show the engine's in-flight count, queue and cap in the metrics."""
        limit = self.limit(name)
        self._in_flight_gauge(name).set(self.in_flight[name])
        self._waiting_gauge(name).set(self.waiting(name))
        self._limit_gauge(name).set(-1 if limit is None else limit)
