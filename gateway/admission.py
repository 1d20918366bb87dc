"""Admission: every request holds one slot for its whole life, and the count it arrives at decides its fate.

For a request of priority class *c*, with *n* admitted requests already in flight across the gateway:

    tenant's own count >= its quota        → 429 rate_limit_exceeded, Retry-After
    n >= hard limit of c                   → 503 overloaded, Retry-After
    n >= soft limit of c                   → admitted above the soft limit: the ``load-shedding`` policy
                                             serves speech requests text-only
    otherwise                              → admitted, served as asked

The slot is taken before the body is read and released once, when the request's holdings close
(``ctx.holds``, core/context.py: completion, error, client disconnect, cancellation alike). Counts live
in this process (:class:`LocalSlots`), or in Redis (:class:`RedisSlots`) when several replicas share one
limit: each slot is a lease with an expiry, taken and given back by Lua scripts so that check-and-take is
atomic, renewed by a heartbeat only while the request that took it is alive (its task has not ended), and
left to expire when a replica dies. A lease whose request ended without giving it back is a leak: it is
not renewed but given back, and logged (``admission_lease_leaked``). When Redis cannot be reached the
gateway fails open to local limits (a share of each limit per replica), loudly.

A background loop reads the count and drives the overload state (:func:`decide_overload`), which lowers the
engines' concurrency caps (``EnginePool.set_overloaded``); the request path never waits on it.

Every decision is written to the request's audit record (``ctx.record.admission``, the record's ``control.admission``), and every
request shed for load is counted once in ``omnigate_admission_shed_total`` by reason: ``tenant_quota``,
``overload``, ``text_only`` (counted when the request finishes) and ``engine_busy`` (engines/selection/slots.py).

Its length: the local and the Redis-shared counters implement one admission rule and are kept side by
side so the two cannot drift.

Its length: the decision table above, the local and Redis slot stores that count for it and the overload
loop that reads them are kept together while the Redis lease scripts are still shared with
engines/selection/slots.py; moving both stores' leases into one lease module is the split still owed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog

from core.context import DEGRADED_TEXT_ONLY, LoadSnapshot, RequestContext
from core.errors import InvalidRequest, Overloaded, PermissionDenied, RateLimited
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RedisSettings, TrafficSettings
from observability.metrics import Metrics

log = structlog.get_logger("omnigate.traffic")

Result = Literal["admit", "refuse_quota", "refuse_overload"]


# -- pure decisions -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Limits:
    soft: int
    hard: int
    tenant_quota: int | None = None

    def scaled(self, share: float) -> Limits:
        """The limits one replica applies alone (fail-open): a share of each, never below 1 for hard ones."""
        if share >= 1.0:
            return self
        quota = None if self.tenant_quota is None else max(1, math.floor(self.tenant_quota * share))
        return Limits(math.floor(self.soft * share), max(1, math.floor(self.hard * share)), quota)


def decide(in_flight: int, tenant_in_flight: int, limits: Limits) -> Result:
    """Whether a request arriving at these counts is admitted. The Lua acquire script mirrors this."""
    if limits.tenant_quota is not None and tenant_in_flight >= limits.tenant_quota:
        return "refuse_quota"
    if in_flight >= limits.hard:
        return "refuse_overload"
    return "admit"


def decide_overload(overloaded: bool, in_flight: int, enter_above: int, exit_at_or_below: int) -> bool:
    """The overload state, with hysteresis: entered above ``enter_above``, left at or below ``exit_at_or_below``."""
    if overloaded:
        return in_flight > exit_at_or_below
    return in_flight > enter_above


@dataclass(frozen=True, slots=True)
class Grant:
    result: Result
    in_flight: int
    tenant_in_flight: int
    limits: Limits
    store: SlotStore


class Ticket:
    """One admitted request's slot; :meth:`release` gives it back exactly once, however often it is called."""

    __slots__ = ("lease_id", "released", "store", "tenant")

    def __init__(self, lease_id: str, tenant: str | None, store: SlotStore) -> None:
        self.lease_id = lease_id
        self.tenant = tenant
        self.store = store
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.store.release(self)


class SlotStore(Protocol):
    name: str

    async def start(self) -> None: ...

    async def acquire(self, lease_id: str, tenant: str | None, limits: Limits) -> Grant: ...

    def release(self, ticket: Ticket) -> None: ...

    async def in_flight(self) -> int: ...

    async def aclose(self) -> None: ...


# -- in-process counts ------------------------------------------------------------------------------------
class LocalSlots:
    """Counts in this process. The event loop runs one acquire at a time, so check-and-take is atomic."""

    name = "local"

    def __init__(self) -> None:
        self.count = 0
        self.tenants: dict[str, int] = {}

    async def start(self) -> None:
        return None

    async def acquire(
        self, lease_id: str, tenant: str | None, limits: Limits, base: int = 0, tenant_base: int = 0
    ) -> Grant:
        """``base`` and ``tenant_base`` count slots held elsewhere (a fail-open replica's Redis leases)."""
        n = self.count + base
        tn = (self.tenants.get(tenant, 0) + tenant_base) if tenant is not None else 0
        result = decide(n, tn, limits)
        if result == "admit":
            self.count += 1
            if tenant is not None:
                self.tenants[tenant] = tn + 1
        return Grant(result, n, tn, limits, self)

    def release(self, ticket: Ticket) -> None:
        self.count -= 1
        if ticket.tenant is not None:
            left = self.tenants.get(ticket.tenant, 1) - 1
            if left > 0:
                self.tenants[ticket.tenant] = left
            else:
                self.tenants.pop(ticket.tenant, None)

    async def in_flight(self) -> int:
        return self.count

    async def aclose(self) -> None:
        return None


# -- counts shared through Redis ----------------------------------------------------------------------------
# Each slot is a member of a sorted set scored by its expiry in milliseconds of the Redis server's clock
# (TIME), so replicas' clocks never matter. Expired members are removed before every count.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Decides a batch of acquires in arrival order, exactly as decide() would one by one.
# KEYS[1] slots, KEYS[2..] tenants' slots (only for quotas)
# ARGV[1] ttl ms, then per request: lease id, hard limit, tenant quota, index into KEYS of its tenant (0: none)
# -> per request {1 admitted | 2 refused: quota | 3 refused: hard limit, in flight before, tenant's before}
ACQUIRE_LUA = (
    _NOW
    + """
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
local tn = {}
for k = 2, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now)
  tn[k] = redis.call('ZCARD', KEYS[k])
end
local out = {}
for i = 2, #ARGV, 4 do
  local lease, hard, quota, k = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local t = 0
  if k > 0 then t = tn[k] end
  if k > 0 and t >= quota then
    out[#out + 1] = {2, n, t}
  elseif n >= hard then
    out[#out + 1] = {3, n, t}
  else
    redis.call('ZADD', KEYS[1], now + ttl, lease)
    if k > 0 then
      redis.call('ZADD', KEYS[k], now + ttl, lease)
      tn[k] = t + 1
    end
    out[#out + 1] = {1, n, t}
    n = n + 1
  end
end
for k = 1, #KEYS do
  if redis.call('EXISTS', KEYS[k]) == 1 then redis.call('PEXPIRE', KEYS[k], ttl) end
end
return out
"""
)

# KEYS[1] slots, KEYS[2..] tenant keys; ARGV: (lease id, index into KEYS or 0) pairs -> leases removed
RELEASE_LUA = """
local removed = 0
for i = 1, #ARGV, 2 do
  removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  local k = tonumber(ARGV[i + 1])
  if k > 0 then redis.call('ZREM', KEYS[k], ARGV[i]) end
end
return removed
"""

# KEYS[1] slots, KEYS[2..] tenant keys; ARGV[1] ttl ms, then (lease id, index into KEYS or 0) pairs
# -> the lease ids that were no longer there (expired or removed); they are not brought back
RENEW_LUA = (
    _NOW
    + """
local exp = now + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV, 2 do
  local lease = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], lease) then
    redis.call('ZADD', KEYS[1], 'XX', exp, lease)
    local k = tonumber(ARGV[i + 1])
    if k > 0 then redis.call('ZADD', KEYS[k], 'XX', exp, lease) end
  else
    lost[#lost + 1] = lease
  end
end
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return lost
"""
)

# KEYS[1] slots -> live leases
COUNT_LUA = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)


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
            await _stop(self._loop_task, self._redis.timeout_s * 4 + 1)
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
                result: Result = "admit" if code == 1 else "refuse_quota" if code == 2 else "refuse_overload"
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
        keys = [self.slots_key]
        args: list[str | int] = [self._ttl_ms]
        for p in batch:
            k = 0
            if p.tenant_key is not None:
                if p.tenant_key not in keys:
                    keys.append(p.tenant_key)
                k = keys.index(p.tenant_key) + 1
            args += [p.lease_id, p.limits.hard, p.limits.tenant_quota or 0, k]
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
        keys = [self.slots_key]
        args: list[str | int] = []
        for lease, tkey in leases:
            k = 0
            if tkey is not None:
                if tkey not in keys:
                    keys.append(tkey)
                k = keys.index(tkey) + 1
            args += [lease, k]
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

    def _leaked(self) -> list[tuple[str, str | None]]:
        """The leases whose request has ended without giving them back, taken out of ``held``."""
        gone = [lease for lease, owner in self.owners.items() if owner.done()]
        out = []
        for lease in gone:
            del self.owners[lease]
            if lease in self.held:
                out.append((lease, self.held.pop(lease)))
        return out

    async def _renew_all(self) -> None:
        leaked = self._leaked()
        if leaked:
            # Renewal is tied to the request, not to the replica: a lease nobody will release is given
            # back now, where renewing it would hold the slot on every replica for as long as this one lives.
            self._metrics.lease_renewals.labels("leaked").inc(len(leaked))
            log.error("admission_lease_leaked", leases=[lease for lease, _ in leaked])
            await self._give_back(leaked)
        if not self.held:
            return
        keys = [self.slots_key]
        index: dict[str, int] = {}
        args: list[str | int] = [self._ttl_ms]
        for lease, tkey in list(self.held.items()):
            k = 0
            if tkey is not None:
                if tkey not in index:
                    keys.append(tkey)
                    index[tkey] = len(keys)
                k = index[tkey]
            args += [lease, k]
        try:
            async with asyncio.timeout(self._redis.timeout_s * 4):
                lost = await self._renew(keys=keys, args=args)
        except Exception as exc:
            self._mark_down("renew", exc)
            return
        renewed = (len(args) - 1) // 2 - len(lost)
        self._metrics.lease_renewals.labels("renewed").inc(renewed)
        for raw in lost:
            lease = raw.decode() if isinstance(raw, bytes) else str(raw)
            self.owners.pop(lease, None)
            if self.held.pop(lease, False) is not False:
                # Only a lease that was still held is lost; one released meanwhile is simply gone.
                self._metrics.lease_renewals.labels("lost").inc()
                log.warning(
                    "admission_lease_lost",
                    lease=lease,
                    reason="expired in Redis before renewal; the stream runs on uncounted",
                )


async def _stop(task: asyncio.Task[None], timeout: float) -> None:
    """Cancel a background loop and wait for it, boundedly.

    The loops also stop on their own flag after their current (time-bounded) step: a cancellation that
    lands inside a Redis call is not always honoured by the client library.
    """
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        log.warning("admission_loop_did_not_stop", task=task.get_name())


# -- the gate --------------------------------------------------------------------------------------------
class AdmissionGate:
    """Resolves the request's class, takes its slot, refuses above the limits, and drives the overload state."""

    def __init__(
        self,
        cfg: TrafficSettings,
        metrics: Metrics,
        on_overload: Callable[[bool], None] | None = None,
        replica_id: str | None = None,
        redis: SharedRedis | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._timeout_s = redis.settings.timeout_s if redis is not None else RedisSettings().timeout_s
        self.store: LocalSlots | RedisSlots = (
            RedisSlots(cfg, metrics, self.replica_id, redis)
            if redis is not None and redis.configured
            else LocalSlots()
        )
        self._on_overload = on_overload
        self._rank = {c.name: i for i, c in enumerate(cfg.priorities)}
        self._limits = {c.name: cfg.class_limits(c.name) for c in cfg.priorities}
        self._header_classes = frozenset(cfg.header_classes())
        self._ids = itertools.count(1)
        self.overloaded = False
        self._monitor_task: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        await self.store.start()
        self.metrics.overloaded.set(0)
        self._monitor_task = asyncio.create_task(self._monitor(), name="admission-overload-monitor")
        log.info(
            "admission_ready",
            store=self.store.name,
            soft_limit=self.cfg.soft_limit,
            hard_limit=self.cfg.hard_limit,
            priorities={name: {"soft": s, "hard": h} for name, (s, h) in self._limits.items()},
        )

    async def aclose(self) -> None:
        self._closing = True
        if self._monitor_task is not None:
            await _stop(self._monitor_task, self._timeout_s * 4 + 1)
        await self.store.aclose()

    # -- the request path ----------------------------------------------------------------------------------
    def priority_of(self, ctx: RequestContext) -> str:
        """The class the request runs in: its tenant's, or a lower one it asked for by header."""
        own = ctx.identity.priority if ctx.identity.priority in self._rank else self.cfg.default_priority
        asked = ctx.identity.requested_priority
        if asked is None:
            return own
        asked = asked.strip().lower()
        header = self.cfg.priority_header
        if asked not in self._rank:
            known = ", ".join(self._rank)
            raise InvalidRequest(
                f"unknown priority class {asked!r} in header {header} (classes: {known})",
                code="invalid_priority",
            )
        if asked != own and (asked not in self._header_classes or self._rank[asked] < self._rank[own]):
            raise PermissionDenied(f"priority class {asked!r} may not be requested with header {header}")
        return asked

    async def admit(self, ctx: RequestContext) -> Ticket:
        priority = self.priority_of(ctx)
        soft, hard = self._limits[priority]
        quota = ctx.identity.tenant_max_concurrency
        tenant = (ctx.identity.tenant or "default") if quota is not None else None
        lease_id = f"{self.replica_id}:{next(self._ids)}"
        t0 = time.perf_counter()
        grant = await self.store.acquire(lease_id, tenant, Limits(soft, hard, quota))
        self.metrics.admission_duration.labels(grant.store.name).observe(time.perf_counter() - t0)
        load = ctx.load = LoadSnapshot(
            priority, grant.in_flight, grant.limits.soft, grant.limits.hard, grant.store.name
        )
        if grant.result == "admit":
            result = "above_soft_limit" if load.above_soft_limit else "admitted"
        else:
            result = "refused_quota" if grant.result == "refuse_quota" else "refused_overload"
        ctx.record.admission = {
            "result": result,
            "priority": priority,
            "in_flight": grant.in_flight,
            "soft_limit": grant.limits.soft,
            "hard_limit": grant.limits.hard,
            "tenant_in_flight": grant.tenant_in_flight if quota is not None else None,
            "tenant_quota": grant.limits.tenant_quota,
            "store": grant.store.name,
            "overloaded": self.overloaded,
        }
        self.metrics.admissions.labels(priority, result).inc()
        retry_after = self.cfg.retry_after_s
        if grant.result == "refuse_quota":
            self.metrics.admission_shed.labels("tenant_quota").inc()
            raise RateLimited(
                f"too many concurrent requests for this tenant (quota {grant.limits.tenant_quota})",
                retry_after=retry_after,
            )
        if grant.result == "refuse_overload":
            self.metrics.admission_shed.labels("overload").inc()
            raise Overloaded("the gateway is overloaded; retry later", retry_after=retry_after)
        return Ticket(lease_id, tenant, grant.store)

    def finished(self, ctx: RequestContext) -> None:
        """The request is over: count it if it was shed to text-only. (Its slot is one of its holdings,
        given back when they close.)"""
        if DEGRADED_TEXT_ONLY in ctx.outputs.degraded:
            self.metrics.admission_shed.labels("text_only").inc()

    async def full(self) -> bool:
        """Whether a request of the default class would be refused for load now (``/readyz`` asks)."""
        n = await self.store.in_flight()
        hard = self._limits[self.cfg.default_priority][1]
        if isinstance(self.store, RedisSlots) and not self.store.up:
            hard = max(1, math.floor(hard * self.cfg.fail_open_share))  # this replica's share, alone
        return n >= hard

    # -- the overload control loop (off the request path) ------------------------------------------------------
    async def _monitor(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.cfg.monitor_interval_s)
            try:
                await self.observe()
            except Exception as exc:  # the loop must outlive any one bad reading
                log.warning("admission_monitor_failed", error=repr(exc))

    async def observe(self) -> bool:
        """Read the count once and update the overload state; returns the state."""
        n = await self.store.in_flight()
        self.metrics.admission_in_flight.set(n)
        state = decide_overload(self.overloaded, n, self.cfg.soft_limit, self.cfg.overload_exit)
        if state != self.overloaded:
            self.overloaded = state
            log.warning(
                "gateway_overload_changed",
                overloaded=state,
                in_flight=n,
                soft_limit=self.cfg.soft_limit,
                exit_at_or_below=self.cfg.overload_exit,
            )
            if self._on_overload is not None:
                self._on_overload(
                    state
                )  # the engine limits first: whoever sees the gauge flip sees them applied
            self.metrics.overloaded.set(1 if state else 0)
        return state
