"""Settings of admission and load shedding, per-tenant rate limits, and the one Redis the replicas share."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from core.settings import Priority


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PriorityClass(_Strict):
    """A request class. Its limits are shares of the gateway's, so they follow when those change."""

    name: Priority = Field(description="the class's name (tenants' priority, the priority header)")
    soft_share: Annotated[float, Field(ge=0, le=64)] = Field(
        default=1.0, description="its soft limit: this share of traffic.soft_limit (at most its hard limit)"
    )
    hard_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=1.0, description="its hard limit: this share of traffic.hard_limit"
    )


def _default_priorities() -> list[PriorityClass]:
    return [
        PriorityClass(name="interactive", soft_share=2.0),
        PriorityClass(name="standard"),
        PriorityClass(name="batch", soft_share=0.5, hard_share=0.75),
    ]


class TrafficSettings(_Strict):
    """Admission and load shedding (gateway/admission.py); shared across replicas when ``redis.url`` is set."""

    enabled: bool = Field(
        default=True, description="false: no admission limits (per-engine caps still apply)"
    )
    soft_limit: Annotated[int, Field(ge=0)] = Field(
        default=16, description="above this many requests in flight, speech is shed (served text-only)"
    )
    hard_limit: Annotated[int, Field(ge=1)] = Field(
        default=64, description="above this many requests in flight, requests are refused with 503"
    )
    retry_after_s: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="Retry-After on a 503 or 429"
    )
    priorities: Annotated[list[PriorityClass], Field(min_length=1)] = Field(
        default_factory=_default_priorities, description="request classes, highest priority first"
    )
    default_priority: str = Field(default="standard", description="the class of requests without a tenant")
    priority_header: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,64}$")] = Field(
        default="x-omnigate-priority", description="the header a client moves itself down with"
    )
    header_priorities: list[str] | None = Field(
        default=None,
        description="classes a client may pick with the priority header (never above its own class); "
        "default: default_priority and every class below it",
    )
    overload_exit_below: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="the overload state (engine limits lowered) ends at or below this; default 3/4 of soft_limit",
    )
    monitor_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5, description="how often the admitted count is read to switch the engines' overload caps"
    )
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9:_.-]{1,64}$")] = Field(
        default="omnigate:traffic", description="Redis key prefix (one per gateway fleet)"
    )
    lease_ttl_s: Annotated[float, Field(ge=0.2, le=3600)] = Field(
        default=30.0, description="a slot held by a replica that stops renewing it expires after this"
    )
    heartbeat_s: Annotated[float, Field(gt=0, le=600)] | None = Field(
        default=None, description="how often a replica renews its leases; default lease_ttl_s / 3"
    )
    fail_open_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=1.0, description="share of each limit one replica applies alone while Redis is unreachable"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrafficSettings:
        if self.soft_limit > self.hard_limit:
            raise ValueError(f"soft_limit ({self.soft_limit}) exceeds hard_limit ({self.hard_limit})")
        names = [c.name for c in self.priorities]
        if len(set(names)) != len(names):
            raise ValueError("priorities: a class name is used twice")
        if self.default_priority not in names:
            raise ValueError(f"default_priority {self.default_priority!r} is not a class in priorities")
        for h in self.header_priorities or ():
            if h not in names:
                raise ValueError(f"header_priorities: {h!r} is not a class in priorities")
        above: tuple[int, int] | None = None
        for c in self.priorities:
            soft, hard = self.class_limits(c.name)
            if above is not None and (soft > above[0] or hard > above[1]):
                raise ValueError(
                    f"priorities: class {c.name!r} has higher limits than the class above it "
                    "(list classes highest priority first)"
                )
            above = (soft, hard)
        if self.overload_exit > self.soft_limit:
            raise ValueError(
                f"overload_exit_below ({self.overload_exit}) exceeds soft_limit ({self.soft_limit})"
            )
        if self.heartbeat_s is not None and self.heartbeat_s >= self.lease_ttl_s:
            raise ValueError("heartbeat_s must be shorter than lease_ttl_s")
        return self

    def class_limits(self, name: str) -> tuple[int, int]:
        """(soft, hard) limits of a class in requests in flight."""
        for c in self.priorities:
            if c.name == name:
                hard = max(1, math.floor(self.hard_limit * c.hard_share))
                return min(hard, math.floor(self.soft_limit * c.soft_share)), hard
        raise KeyError(name)

    def header_classes(self) -> list[str]:
        if self.header_priorities is not None:
            return list(self.header_priorities)
        names = [c.name for c in self.priorities]
        return names[names.index(self.default_priority) :]

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_ttl_s / 3

    @property
    def overload_exit(self) -> int:
        return (
            self.overload_exit_below if self.overload_exit_below is not None else (self.soft_limit * 3) // 4
        )


class RateLimitSettings(_Strict):
    """Per-tenant rate limits, shared by every replica through Redis when ``redis.url`` is set."""

    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = Field(
        default="omnigate", description="Redis key prefix of the counters"
    )
    fail_open: bool = Field(default=True, description="serve unlimited while Redis is unreachable")


class RedisSettings(_Strict):
    """The one Redis the replicas share (gateway/redis_client.py): admission slots, rate limits, failed
    authentications and the routing state each keep their keys under their own prefix, over one
    connection pool per replica."""

    url: SecretStr | None = Field(
        default=None,
        description="redis://[user:password@]host:port/db (secret: never logged or printed); "
        "unset: every count stays in its own process and routing.state.backend redis is refused",
    )
    timeout_s: Annotated[float, Field(gt=0, le=30)] = Field(
        default=0.25, description="a Redis call slower than this counts as Redis unreachable"
    )
    max_connections: Annotated[int, Field(ge=1, le=10000)] = Field(
        default=64, description="connections to Redis per replica; more callers wait up to timeout_s"
    )
    probe_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=1.0, description="while Redis is unreachable, how often admission tries it again"
    )
