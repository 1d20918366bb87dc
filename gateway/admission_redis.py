"""Admission slots shared by every replica through Redis (:class:`RedisSlots`), for gateway/admission.py's gate.

Each admitted request holds a lease in Redis (the protocol: :mod:`core.leases`): one sorted set counts every
replica's requests (``{traffic.key_prefix}:slots``), and one per tenant with a quota
(``{traffic.key_prefix}:tenant:<tenant>``). Acquires made in one turn of the event loop go to Redis in one
script call, decided in arrival order exactly as :func:`gateway.admission_slots.decide` would one by one;
releases are batched the same way. A lease is renewed by a heartbeat (``traffic.heartbeat_interval_s``) only
while the request that took it is alive; one whose request ended without giving it back is given back and
logged (``admission_lease_leaked``), and a dead replica's leases expire after ``traffic.lease_ttl_s``.

When Redis cannot be reached the store fails open to a :class:`~gateway.admission_slots.LocalSlots` with a
share of each limit (``traffic.fail_open_share``), counting the leases this replica still holds, loudly
(``traffic_store_unreachable``), and probes Redis every ``redis.probe_s`` until it answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from core.leases import (
    ACQUIRE_LUA,
    COUNT_LUA,
    GRANTED,
    REFUSED_QUOTA,
    RELEASE_LUA,
    RENEW_LUA,
    acquire_call,
    lease_ids,
    release_call,
    renew_call,
)
from gateway.admission_leaks import take_leaked
from gateway.admission_slots import Grant, Limits, LocalSlots, Result, Ticket, stop_loop
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import TrafficSettings
from observability.metrics import Metrics

log = structlog.get_logger("omnigate.traffic")


@dataclass(eq=False, slots=True)
class _PendingAcquire:
    lease_id: str
    tenant_key: str | None
    limits: Limits
    future: asyncio.Future[list[int]]


class _StoreDown(Exception):
    """The batch this acquire was in could not reach Redis."""


class RedisSlots:
    """Leases in Redis shared by every replica, with a local fallback while Redis is unreachable."""

    name = "redis"

    def __init__(self, cfg: TrafficSettings, metrics: Metrics, replica_id: str, redis: SharedRedis) -> None:
        self._cfg = cfg
        self._redis = redis.settings
        self._metrics = metrics
        self.replica_id = replica_id
        self._ttl_ms = int(cfg.lease_ttl_s * 1000)
        # The replica's shared pool: no retries and a bounded wait for a connection (gateway/redis_client.py),
        # so a slow or absent Redis costs at most one timeout before failing open.
        self.client = redis.client()
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._release = self.client.register_script(RELEASE_LUA)
        self._renew = self.client.register_script(RENEW_LUA)
        self._count = self.client.register_script(COUNT_LUA)
        self.slots_key = f"{{{cfg.key_prefix}}}:slots"
        self._tenant_prefix = f"{{{cfg.key_prefix}}}:tenant:"
        self.held: dict[str, str | None] = {}  # lease id -> tenant key
        #: lease id -> the task of the request that took it: renewed only while that task runs
        self.owners: dict[str, asyncio.Task[Any]] = {}
        self._releasing: list[tuple[str, str | None]] = []
        self._acquiring: list[_PendingAcquire] = []
        self.fallback = LocalSlots()
        self.up: bool | None = None  # None until the first answer or failure
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False

    def tenant_key(self, tenant: str) -> str:
        return self._tenant_prefix + tenant

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._probe()
        self._loop_task = asyncio.create_task(self._maintain(), name="admission-lease-heartbeat")

    async def aclose(self) -> None:
        self._closing = True
        if self._loop_task is not None:
            await stop_loop(self._loop_task, self._redis.timeout_s * 4 + 1)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        # Streams still open at shutdown: give their slots back now rather than after the TTL.
        if self.held:
            await self._give_back(list(self.held.items()))
        self.held.clear()
        self.owners.clear()
        await self.client.aclose()  # the pool stays open for the other users; the services close it

    # -- the request path ----------------------------------------------------------------------------------
    async def acquire(self, lease_id: str, tenant: str | None, limits: Limits) -> Grant:
        if self.up:
            tkey = self.tenant_key(tenant) if tenant is not None and limits.tenant_quota is not None else None
            # Acquires made in one turn of the event loop go to Redis together, decided in arrival order.
            pending = _PendingAcquire(lease_id, tkey, limits, asyncio.get_running_loop().create_future())
            self._acquiring.append(pending)
            if len(self._acquiring) == 1:
                self._spawn(self._flush_acquires())
            try:
                code, n, tn = await pending.future
            except asyncio.CancelledError:
                # Not sent yet: it never will be. Sent: _flush_acquires gives the slot back when it lands.
                if pending in self._acquiring:
                    self._acquiring.remove(pending)
                raise
            except _StoreDown:
                pass
            else:
                result: Result = (
                    "admit"
                    if code == GRANTED
                    else "refuse_quota"
                    if code == REFUSED_QUOTA
                    else "refuse_overload"
                )
                if result == "admit":
                    self.held[lease_id] = tkey
                    owner = asyncio.current_task()
                    if owner is not None:
                        self.owners[lease_id] = owner
                return Grant(result, int(n), int(tn), limits, self)
        self._metrics.admission_fail_open.inc()
        # Alone, this replica counts what it holds: its Redis leases as well as its local slots.
        tkey = self.tenant_key(tenant) if tenant is not None else None
        return await self.fallback.acquire(
            lease_id,
            tenant,
            limits.scaled(self._cfg.fail_open_share),
            base=len(self.held),
            tenant_base=sum(1 for k in self.held.values() if k is not None and k == tkey),
        )

    async def _flush_acquires(self) -> None:
        await asyncio.sleep(0)
        batch, self._acquiring = self._acquiring, []
        if not batch:
            return
        keys, args = acquire_call(
            self.slots_key,
            self._ttl_ms,
            ((p.lease_id, p.limits.hard, p.limits.tenant_quota, p.tenant_key) for p in batch),
        )
        try:
            async with asyncio.timeout(self._redis.timeout_s * 2):
                results = await self._acquire(keys=keys, args=args)
        except Exception as exc:  # redis errors, OSError, timeouts: all mean "unreachable" here
            self._mark_down("acquire", exc)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(_StoreDown())
            return
        orphans = []
        for p, res in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(res)
            elif res[0] == 1:
                orphans.append((p.lease_id, p.tenant_key))  # its caller left while the script ran
        if orphans:
            await self._give_back(orphans)

    def release(self, ticket: Ticket) -> None:
        # Releases made in one turn of the event loop go to Redis together, in one script call.
        self.owners.pop(ticket.lease_id, None)
        self._releasing.append((ticket.lease_id, self.held.pop(ticket.lease_id, None)))
        if len(self._releasing) == 1:
            self._spawn(self._flush_releases())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush_releases(self) -> None:
        await asyncio.sleep(0)
        batch, self._releasing = self._releasing, []
        await self._give_back(batch)

    async def _give_back(self, leases: list[tuple[str, str | None]]) -> None:
        keys, args = release_call(self.slots_key, leases)
        try:
            async with asyncio.timeout(self._redis.timeout_s * 2):
                await self._release(keys=keys, args=args)
        except Exception as exc:
            # The leases expire by themselves after lease_ttl_s: nothing renews them any more.
            self._metrics.traffic_store_errors.labels("release").inc()
            log.warning(
                "admission_release_failed",
                leases=len(leases),
                error=repr(exc),
                expires_in_s=self._cfg.lease_ttl_s,
            )

    async def in_flight(self) -> int:
        if self.up:
            try:
                async with asyncio.timeout(self._redis.timeout_s * 2):
                    return int(await self._count(keys=[self.slots_key]))
            except Exception as exc:
                self._mark_down("count", exc)
        return len(self.held) + self.fallback.count

    # -- health and leases (off the request path) -------------------------------------------------------------
    def _mark_down(self, op: str, exc: BaseException) -> None:
        self._metrics.traffic_store_errors.labels(op).inc()
        if self.up is not False:
            self.up = False
            self._metrics.traffic_store_up.set(0)
            log.error(
                "traffic_store_unreachable",
                op=op,
                error=repr(exc),
                action="failing open to local limits",
                fail_open_share=self._cfg.fail_open_share,
            )

    def _mark_up(self) -> None:
        if self.up is False:
            log.warning("traffic_store_recovered", action="sharing limits through Redis again")
        self.up = True
        self._metrics.traffic_store_up.set(1)

    async def _probe(self) -> None:
        try:
            async with asyncio.timeout(self._redis.timeout_s * 2):
                await self.client.ping()
        except Exception as exc:
            self._mark_down("ping", exc)
        else:
            self._mark_up()

    async def _maintain(self) -> None:
        """Renew this replica's leases every heartbeat; while Redis is down, probe it every redis.probe_s."""
        heartbeat = self._cfg.heartbeat_interval_s
        tick = min(heartbeat, self._redis.probe_s)
        next_renew = time.monotonic() + heartbeat
        while not self._closing:
            await asyncio.sleep(tick)
            if not self.up:
                await self._probe()
            elif time.monotonic() >= next_renew:
                await self._renew_all()
                next_renew = time.monotonic() + heartbeat

    async def _renew_all(self) -> None:
        leaked = take_leaked(self.owners, self.held)
        if leaked:
            # Renewal is tied to the request, not to the replica: a lease nobody will release is given
            # back now, where renewing it would hold the slot on every replica for as long as this one lives.
            self._metrics.lease_renewals.labels("leaked").inc(len(leaked))
            log.error("admission_lease_leaked", leases=[lease for lease, _ in leaked])
            await self._give_back(leaked)
        if not self.held:
            return
        renewing = list(self.held.items())
        keys, args = renew_call(self.slots_key, self._ttl_ms, renewing)
        try:
            async with asyncio.timeout(self._redis.timeout_s * 4):
                lost = await self._renew(keys=keys, args=args)
        except Exception as exc:
            self._mark_down("renew", exc)
            return
        gone = lease_ids(lost)
        self._metrics.lease_renewals.labels("renewed").inc(len(renewing) - len(gone))
        for lease in gone:
            self.owners.pop(lease, None)
            if self.held.pop(lease, False) is not False:
                # Only a lease that was still held is lost; one released meanwhile is simply gone.
                self._metrics.lease_renewals.labels("lost").inc()
                log.warning(
                    "admission_lease_lost",
                    lease=lease,
                    reason="expired in Redis before renewal; the stream runs on uncounted",
                )
