"""Engine caps shared by every replica through Redis (:class:`SharedCaps`), for the slots of
:mod:`engines.selection.slots`.

With Redis configured, every slot a replica grants on an engine is also a lease in Redis (the protocol:
:mod:`core.leases`): one sorted set per engine (``{traffic.key_prefix}:engine:<name>``), taken by the
acquire script with the engine's cap as the hard limit, so the engine never has more requests in flight
than its cap however many replicas send to it. A slot handed to a waiter keeps its lease; a lease is
renewed by a heartbeat only while the request holding it lives (one whose request ended without giving it
back is given back and logged, ``engine_lease_leaked``), and a killed replica's leases expire after
``traffic.lease_ttl_s``. Redis unreachable: as admission does, each replica fails open to a share of each
cap (``traffic.fail_open_share``, :meth:`SharedCaps.fail_open_cap`), loudly, and probes Redis until it
answers.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from typing import Any

import structlog

from core.leases import (
    ACQUIRE_LUA,
    COUNT_LUA,
    GRANTED,
    RELEASE_LUA,
    RENEW_LUA,
    acquire_call,
    lease_ids,
    release_call,
    renew_call,
)
from observability.metrics import Metrics

log = structlog.get_logger("engines.pool")

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
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._give = client.register_script(RELEASE_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._count = client.register_script(COUNT_LUA)
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
        # an acquire of one, with the engine's cap as the hard limit and no tenant key
        keys, args = acquire_call(self.key(engine), self._ttl_ms, [(lease, cap, None, None)])
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                ((code, _, _),) = await self._acquire(keys=keys, args=args)
        except asyncio.CancelledError:
            # The script may have run: give the lease back (a no-op if it was not taken).
            self._spawn(self._give_back([(lease, engine)]))
            raise
        except Exception as exc:  # redis errors, OSError, timeouts: all mean "unreachable" here
            self._spawn(self._give_back([(lease, engine)]))
            self._mark_down("engine_acquire", exc)
            return DOWN, None
        if code != GRANTED:
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
            keys, args = release_call(self.key(engine), ((lease, None) for lease in ids))
            try:
                async with asyncio.timeout(self._timeout_s * 2):
                    await self._give(keys=keys, args=args)
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
            keys, args = renew_call(self.key(engine), self._ttl_ms, ((lease, None) for lease in ids))
            try:
                async with asyncio.timeout(self._timeout_s * 4):
                    lost = await self._renew(keys=keys, args=args)
            except Exception as exc:
                self._mark_down("engine_renew", exc)
                return
            for lease in lease_ids(lost):
                if self.held.pop(lease, None) is not None:
                    self.owners.pop(lease, None)
                    log.warning(
                        "engine_lease_lost",
                        engine=engine,
                        lease=lease,
                        reason="expired in Redis before renewal; the request runs on uncounted",
                    )
