"""The places of ``/v1/realtime`` sessions, per key (``realtime.max_sessions_per_key``): counted in this process
(:class:`LocalPlaces`), or by every replica together through Redis when ``redis.url`` is set (:class:`SharedPlaces`).

Shared, a session's place is a lease in Redis (the protocol: :mod:`core.leases`, as admission slots and
engine caps): one sorted set per key (``{traffic.key_prefix}:realtime:<key id, or client address>``), taken
by the acquire script with the cap as its hard limit, so two handshakes at once on two replicas cannot both
take the last place. A lease is renewed every ``traffic.heartbeat_interval_s`` only while the session that
took it lives (one whose session ended without giving it back is given back and logged,
``realtime_place_leaked``); a killed replica's places expire after ``traffic.lease_ttl_s``. Redis
unreachable: as admission does, each replica fails open to a share of the cap (``traffic.fail_open_share``,
never below one), counting the places it still holds in Redis, loudly (``realtime_places_store_unreachable``),
and probes Redis every ``redis.probe_s`` until it answers again.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import structlog

from core.leases import (
    ACQUIRE_LUA,
    GRANTED,
    RELEASE_LUA,
    RENEW_LUA,
    acquire_call,
    lease_ids,
    release_call,
    renew_call,
)
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import TrafficSettings
from observability.metrics import Metrics

log = structlog.get_logger("omnigate.realtime")


class Place:
    """One session's place; :meth:`release` gives it back once, however often it is called."""

    __slots__ = ("_give",)

    def __init__(self, give: Callable[[], None]) -> None:
        self._give: Callable[[], None] | None = give

    def release(self) -> None:
        give, self._give = self._give, None
        if give is not None:
            give()


class Places(Protocol):
    async def take(self, who: str, cap: int) -> Place | None:
        """A place for one more session of ``who`` if it holds fewer than ``cap``; None: refused."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class LocalPlaces:
    """The count of this process alone."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    async def take(self, who: str, cap: int) -> Place | None:
        return self.take_now(who, cap)

    def take_now(self, who: str, cap: int, elsewhere: int = 0) -> Place | None:
        # No await between the count and the increment: two handshakes at once cannot both take the last place.
        n = self.open.get(who, 0)
        if n + elsewhere >= cap:
            return None
        self.open[who] = n + 1
        return Place(functools.partial(self._give, who))

    def _give(self, who: str) -> None:
        self.open[who] -= 1
        if not self.open[who]:
            del self.open[who]

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class SharedPlaces:
    """Places as leases in Redis, shared by every replica (see the module docstring)."""

    def __init__(
        self, traffic: TrafficSettings, redis: SharedRedis, metrics: Metrics, replica_id: str | None = None
    ) -> None:
        self._cfg = traffic
        self._timeout_s, self._probe_s = redis.settings.timeout_s, redis.settings.probe_s
        self._metrics = metrics
        self._ttl_ms = int(traffic.lease_ttl_s * 1000)
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self.client = redis.client()  # over the replica's shared pool: no retries, bounded waits
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._give = self.client.register_script(RELEASE_LUA)
        self._renew = self.client.register_script(RENEW_LUA)
        #: lease id -> who, for every place this replica holds in Redis
        self.held: dict[str, str] = {}
        #: lease id -> the task of the session holding it: renewed only while that task runs
        self.owners: dict[str, asyncio.Task[Any]] = {}
        self.fallback = LocalPlaces()
        self.up: bool | None = None  # None until the first answer or failure
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False

    def key(self, who: str) -> str:
        return f"{{{self._cfg.key_prefix}}}:realtime:{who}"

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._probe()
        self._loop_task = asyncio.create_task(self._maintain(), name="realtime-place-heartbeat")

    async def aclose(self) -> None:
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task}, timeout=self._timeout_s * 4 + 1)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.held:  # sessions still open at shutdown: their places go back now, not after the TTL
            await self._give_back(list(self.held.items()))
        self.held.clear()
        self.owners.clear()
        await self.client.aclose()  # the pool stays open for the other users; the services close it

    # -- the handshake's path ----------------------------------------------------------------------------
    async def take(self, who: str, cap: int) -> Place | None:
        if self.up:
            lease = f"{self.replica_id}:{next(self._ids)}"
            # In a task of its own: a handshake cancelled while the script runs leaves its answer to the
            # callback, which gives a place taken meanwhile back.
            call = self._spawn(self._take_in_redis(lease, who, cap))
            try:
                code = await asyncio.shield(call)
            except asyncio.CancelledError:
                call.add_done_callback(functools.partial(self._orphan, lease, who))
                raise
            if code is not None:
                if code != GRANTED:
                    return None
                self.held[lease] = who
                owner = asyncio.current_task()
                if owner is not None:
                    self.owners[lease] = owner
                return Place(functools.partial(self._release, lease))
        # Alone, this replica counts what it holds: its places in Redis as well as its local ones.
        elsewhere = sum(1 for w in self.held.values() if w == who)
        return self.fallback.take_now(who, max(1, math.floor(cap * self._cfg.fail_open_share)), elsewhere)

    async def _take_in_redis(self, lease: str, who: str, cap: int) -> int | None:
        """The acquire script's code for one lease with ``cap`` as its hard limit; None: Redis unreachable."""
        keys, args = acquire_call(self.key(who), self._ttl_ms, [(lease, cap, None, None)])
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                ((code, _, _),) = await self._acquire(keys=keys, args=args)
        except Exception as exc:  # redis errors, OSError, timeouts: all mean "unreachable" here
            self._mark_down("realtime_acquire", exc)
            # The script may have run before the answer was lost: give the lease back (a no-op if not).
            self._spawn(self._give_back([(lease, who)]))
            return None
        return int(code)

    def _orphan(self, lease: str, who: str, call: asyncio.Task[int | None]) -> None:
        if not call.cancelled() and call.exception() is None and call.result() == GRANTED:
            self._spawn(self._give_back([(lease, who)]))

    def _release(self, lease: str) -> None:
        self.owners.pop(lease, None)
        who = self.held.pop(lease, None)
        if who is not None:  # not lost in Redis meanwhile
            self._spawn(self._give_back([(lease, who)]))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _give_back(self, leases: list[tuple[str, str]]) -> None:
        for who, ids in _by_who(leases).items():
            keys, args = release_call(self.key(who), ((lease, None) for lease in ids))
            try:
                async with asyncio.timeout(self._timeout_s * 2):
                    await self._give(keys=keys, args=args)
            except Exception as exc:
                # Nothing renews them any more: they expire by themselves after lease_ttl_s.
                self._metrics.traffic_store_errors.labels("realtime_release").inc()
                log.warning(
                    "realtime_place_release_failed",
                    places=len(ids),
                    error=repr(exc),
                    expires_in_s=self._cfg.lease_ttl_s,
                )

    # -- health and renewal (off the request path) --------------------------------------------------------
    def _mark_down(self, op: str, exc: BaseException) -> None:
        self._metrics.traffic_store_errors.labels(op).inc()
        if self.up is not False:
            self.up = False
            log.error(
                "realtime_places_store_unreachable",
                op=op,
                error=repr(exc),
                action="failing open to a share of each key's session cap",
                fail_open_share=self._cfg.fail_open_share,
            )

    async def _probe(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s * 2):
                await self.client.ping()
        except Exception as exc:
            self._mark_down("realtime_ping", exc)
        else:
            if self.up is False:
                log.warning(
                    "realtime_places_store_recovered", action="sharing session caps through Redis again"
                )
            self.up = True

    async def _maintain(self) -> None:
        """Renew the places of live sessions every heartbeat; while Redis is down, probe it every probe_s."""
        heartbeat = self._cfg.heartbeat_interval_s
        tick = min(heartbeat, self._probe_s)
        next_renew = time.monotonic() + heartbeat
        while not self._closing:
            await asyncio.sleep(tick)
            try:
                if not self.up:
                    await self._probe()
                elif time.monotonic() >= next_renew:
                    await self.renew_all()
                    next_renew = time.monotonic() + heartbeat
            except Exception as exc:  # the loop must outlive any one bad step
                log.warning("realtime_place_heartbeat_failed", error=repr(exc))

    async def renew_all(self) -> None:
        """Renew the places whose session lives; give back those whose session ended without them."""
        leaked = [lease for lease, owner in self.owners.items() if owner.done()]
        if leaked:
            # Renewal is tied to the session, not to the replica: a place nobody will give back would
            # otherwise be held on every replica for as long as this one lives.
            log.error("realtime_place_leaked", places=leaked)
            for lease in leaked:
                del self.owners[lease]
            await self._give_back([(lease, self.held.pop(lease)) for lease in leaked if lease in self.held])
        for who, ids in _by_who(list(self.held.items())).items():
            keys, args = renew_call(self.key(who), self._ttl_ms, ((lease, None) for lease in ids))
            try:
                async with asyncio.timeout(self._timeout_s * 4):
                    lost = await self._renew(keys=keys, args=args)
            except Exception as exc:
                self._mark_down("realtime_renew", exc)
                return
            for lease in lease_ids(lost):
                self.owners.pop(lease, None)
                if self.held.pop(lease, None) is not None:
                    log.warning(
                        "realtime_place_lost",
                        lease=lease,
                        reason="expired in Redis before renewal; the session runs on uncounted",
                    )


def _by_who(leases: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for lease, who in leases:
        out.setdefault(who, []).append(lease)
    return out
