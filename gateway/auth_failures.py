"""Requests refused for their key: limited per client address, counted, logged by sample, audited in aggregate.

A refused request writes no audit record of its own (that would let anyone grow the
chain one record per request and compete with tenants for the writer); instead each
``summary_interval_s`` one ``auth_failures`` record and one log line carry the counts
by reason, the number of distinct addresses and the busiest few. Over
``max_failures`` failures in ``window_s``, an address is blocked: every attempt from it gets 429
with ``Retry-After`` until the window lets it fail again, the right key as much as a wrong one
(:meth:`AuthFailures.check` runs before the credential is looked at), so a brute force that
eventually guesses right is refused like its wrong guesses and the answer says nothing about the
key. Only failures are counted, and a request from an address that is not blocked costs one
dictionary lookup here.

The window is shared through the replica's Redis pool where one is configured (``store: auto``
with ``redis.url`` set); while Redis cannot be reached, each process counts alone. A replica learns
that an address is blocked at that address's first failure on it (the shared window says so) and
from then on refuses it before any key is checked; until then, the block costs it no Redis call.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import structlog

from core.errors import RateLimited
from gateway.auth_settings import FailureLimitSettings
from gateway.redis_client import SharedRedis
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

#: addresses this process remembers as over the limit, so a flood costs no Redis call per request
_BLOCKED_CACHE = 10_000
_TOP = 5


class TooManyAuthFailures(RateLimited):
    code = "too_many_authentication_failures"


@dataclass(slots=True)
class FailureSummary:
    """What one interval saw: counts by reason and by address (bounded), handed to the audit and the log."""

    since: float = field(default_factory=time.time)
    reasons: Counter[str] = field(default_factory=Counter)
    addresses: Counter[str] = field(default_factory=Counter)
    throttled: int = 0
    #: distinct addresses beyond this many are counted in ``other_addresses`` only (memory stays bounded)
    max_addresses: int = 10_000
    other_addresses: int = 0

    def add(self, address: str, reason: str) -> None:
        self.reasons[reason] += 1
        if address in self.addresses or len(self.addresses) < self.max_addresses:
            self.addresses[address] += 1
        else:
            self.other_addresses += 1

    def empty(self) -> bool:
        return not self.reasons and not self.throttled

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "interval_s": round(now - self.since, 3),
            "refused": sum(self.reasons.values()),
            "by_reason": dict(sorted(self.reasons.items())),
            "throttled": self.throttled,
            "addresses": len(self.addresses) + (1 if self.other_addresses else 0),
            "top_addresses": [{"address": a, "failures": n} for a, n in self.addresses.most_common(_TOP)],
        }


class AuthFailures:
    def __init__(
        self, settings: FailureLimitSettings, metrics: Metrics, *, redis: SharedRedis | None, key_prefix: str
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        # Built on the first failure: a gateway nobody fails against never imports limits or redis.
        self.item: Any = None
        self._local: Any = None
        self._shared: Any = None
        self._redis = redis
        self._prefix = key_prefix
        self._errors: tuple[type[BaseException], ...] = (OSError,)
        self._blocked: OrderedDict[str, float] = OrderedDict()
        self._last_warning = 0.0
        self.summary = FailureSummary()

    def _limiter(self) -> Any:
        if self._local is None:
            from limits import RateLimitItemPerSecond
            from limits.aio.storage import MemoryStorage
            from limits.aio.strategies import MovingWindowRateLimiter

            self.item = RateLimitItemPerSecond(self.settings.max_failures, self.settings.window_s)
            self._local = MovingWindowRateLimiter(MemoryStorage())
        if self._redis is None or not self._redis.configured:
            return self._local
        if self._shared is None:
            from limits.aio.storage import RedisStorage
            from limits.aio.strategies import MovingWindowRateLimiter
            from redis.exceptions import RedisError

            self._errors = (RedisError, OSError)
            storage = RedisStorage(
                "async+" + self._redis.url,
                implementation="redispy",
                key_prefix=self._prefix,
                # limits types its pass-through options as scalars; redis-py takes the pool object as it is
                connection_pool=self._redis.pool,  # type: ignore[arg-type]
            )
            self._shared = MovingWindowRateLimiter(storage)
        return self._shared

    def check(self, address: str) -> None:
        """Refuse ``address`` while it is blocked: called before its credential is looked at.

        The refusal does not depend on the credential, so it can neither let a right guess through nor
        tell the client that it was right.
        """
        until = self._blocked.get(address)
        if until is None:
            return
        left = until - time.monotonic()
        if left > 0:
            self._throttle(left)
        del self._blocked[address]

    async def failed(self, address: str, reason: str) -> None:
        """Count one failure of ``address``; raise :class:`TooManyAuthFailures` when it is over the limit."""
        self.summary.add(address, reason)
        total = sum(self.summary.reasons.values())
        if total == 1 or total % 1000 == 0:
            # A sample, not a line per request: a flood must not become a flood of log lines.
            log.info("auth_failed_sample", reason=reason, client=address, failures_this_interval=total)
        now = time.monotonic()
        until = self._blocked.get(address)
        if until is not None and until > now:
            self._throttle(until - now)
        limiter = self._limiter()
        try:
            allowed = await limiter.hit(self.item, "auth-failures", address)
            if not allowed:
                stats = await limiter.get_window_stats(self.item, "auth-failures", address)
        except self._errors as exc:
            self._unreachable(exc)
            limiter = self._local
            allowed = await limiter.hit(self.item, "auth-failures", address)
            if not allowed:
                stats = await limiter.get_window_stats(self.item, "auth-failures", address)
        if allowed:
            return
        wait = max(1.0, stats.reset_time - time.time())
        self._blocked[address] = now + wait
        self._blocked.move_to_end(address)
        while len(self._blocked) > _BLOCKED_CACHE:
            self._blocked.popitem(last=False)
        self._throttle(wait)

    def _throttle(self, wait: float) -> None:
        self.summary.throttled += 1
        self.metrics.auth_throttled.inc()
        raise TooManyAuthFailures(
            f"Too many failed authentication attempts from this address. Please try again in {wait:.0f}s.",
            retry_after=wait,
        )

    def _unreachable(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 30.0:
            self._last_warning = now
            log.warning(
                "auth_failure_limit_unshared",
                error=type(exc).__name__,
                detail="Redis unreachable: each process counts failures alone",
            )

    def take_summary(self) -> dict[str, Any] | None:
        """The interval's counts (None when nothing was refused), and a fresh interval begins."""
        done, self.summary = self.summary, FailureSummary()
        now = time.monotonic()
        for a in [a for a, until in self._blocked.items() if until <= now]:
            del self._blocked[a]
        return None if done.empty() else done.to_json(time.time())

    async def aclose(self) -> None:
        """Nothing of its own to close: the Redis pool is the services'."""
