"""Admission: every request holds one slot for its whole life, and the count it arrives at decides its fate.

For a request of priority class *c*, with *n* admitted requests already in flight across the gateway:

    tenant's own count >= its quota        → 429 rate_limit_exceeded, Retry-After
    n >= hard limit of c                   → 503 overloaded, Retry-After
    n >= soft limit of c                   → admitted above the soft limit: the ``load-shedding`` policy
                                             serves speech requests text-only
    otherwise                              → admitted, served as asked

The slot is taken before the body is read and released once, when the request's holdings close
(``ctx.holds``, core/context.py: completion, error, client disconnect, cancellation alike). Counts live
in this process (:class:`~gateway.admission_slots.LocalSlots`), or in Redis
(:class:`~gateway.admission_redis.RedisSlots`) when several replicas share one limit: each slot is a lease
with an expiry, taken and given back by Lua scripts (:mod:`core.leases`) so that check-and-take is atomic,
renewed by a heartbeat only while the request that took it is alive (its task has not ended), and left to
expire when a replica dies. A lease whose request ended without giving it back is a leak: it is
not renewed but given back, and logged (``admission_lease_leaked``). When Redis cannot be reached the
gateway fails open to local limits (a share of each limit per replica), loudly.

A background loop reads the count and drives the overload state (:func:`decide_overload`), which lowers the
engines' concurrency caps (``EnginePool.set_overloaded``); the request path never waits on it.

Every decision is written to the request's audit record (``ctx.record.admission``, the record's ``control.admission``), and every
request shed for load is counted once in ``omnigate_admission_shed_total`` by reason: ``tenant_quota``,
``overload``, ``text_only`` (counted when the request finishes) and ``engine_busy`` (engines/selection/slots.py).

Where things are: this module holds the gate (the request's class, its slot, the refusals, the overload
loop); the rule, the store protocol and the in-process store are in gateway/admission_slots.py, the Redis
store in gateway/admission_redis.py, and the lease scripts it runs (shared with the engines' caps) in
core/leases.py. :class:`LocalSlots` applies :func:`~gateway.admission_slots.decide` and the Redis acquire
script mirrors it (a test holds the two to the same answers), so the two stores cannot drift. The rule's
and the stores' names stay importable from here.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Callable

import structlog

from core.context import DEGRADED_TEXT_ONLY, LoadSnapshot, RequestContext
from core.errors import InvalidRequest, Overloaded, PermissionDenied, RateLimited
from gateway.admission_redis import RedisSlots
from gateway.admission_slots import Grant, Limits, LocalSlots, Result, SlotStore, Ticket, decide, stop_loop
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RedisSettings, TrafficSettings
from observability.metrics import Metrics

__all__ = [
    "AdmissionGate",
    "Grant",
    "Limits",
    "LocalSlots",
    "RedisSlots",
    "Result",
    "SlotStore",
    "Ticket",
    "decide",
    "decide_overload",
]

log = structlog.get_logger("omnigate.traffic")


def decide_overload(overloaded: bool, in_flight: int, enter_above: int, exit_at_or_below: int) -> bool:
    """The overload state, with hysteresis: entered above ``enter_above``, left at or below ``exit_at_or_below``."""
    if overloaded:
        return in_flight > exit_at_or_below
    return in_flight > enter_above


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
            await stop_loop(self._monitor_task, self._timeout_s * 4 + 1)
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
