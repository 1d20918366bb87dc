"""Admission's rule and its slot stores' terms: the limits, the decision, the grant, the ticket, the store
protocol, and the store that counts in this process (:class:`LocalSlots`).

:func:`decide` is the rule that the decision table of :mod:`gateway.admission` states. :class:`LocalSlots`
applies it to this process's counts; the Redis store (gateway/admission_redis.py) to every replica's, through
the acquire script of :mod:`core.leases`, which mirrors it, and falls back to a :class:`LocalSlots` while
Redis is unreachable. These live apart from the gate (gateway/admission.py) because the gate builds the
Redis store and the Redis store needs them: in one module with the gate, the two modules would import each
other.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Literal, Protocol

import structlog

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
    """Whether a request arriving at these counts is admitted. core.leases.ACQUIRE_LUA mirrors it."""
    if limits.tenant_quota is not None and tenant_in_flight >= limits.tenant_quota:
        return "refuse_quota"
    if in_flight >= limits.hard:
        return "refuse_overload"
    return "admit"


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


async def stop_loop(task: asyncio.Task[None], timeout: float) -> None:
    """Cancel a background loop and wait for it, boundedly.

    The loops also stop on their own flag after their current (time-bounded) step: a cancellation that
    lands inside a Redis call is not always honoured by the client library.
    """
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        log.warning("admission_loop_did_not_stop", task=task.get_name())
