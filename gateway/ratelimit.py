"""Per-tenant request, token and audio rate limits (the ``limits`` library), shared by every replica
through the replica's Redis pool when ``redis.url`` is set, counted in-process otherwise.

Requests per minute use a moving window: each request takes one slot atomically
before it is served. Tokens and audio seconds per minute are only known afterwards, so
each budget is checked before (a tenant with nothing left is refused) and the usage is
charged after the response, to a fixed one-minute window that counts everything even
past the limit (an overdraft then blocks the tenant until the window resets). Audio is
counted in milliseconds, so that the short turns of a voice session add up.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import structlog

from core.errors import GuardUnavailable, Overloaded, RateLimited
from core.schemas import ChatCompletionRequest
from core.settings import TenantConfig
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RateLimitSettings
from observability.metrics import Metrics

if TYPE_CHECKING:
    from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

    from policies.registry import PolicyChain

log = structlog.get_logger(__name__)

_WARN_EVERY_S = 30.0
#: audio is counted in milliseconds against a limit set in seconds
_MS = 1000


class RateLimiter:
    def __init__(
        self, settings: RateLimitSettings, metrics: Metrics, redis: SharedRedis | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._redis = redis
        self._requests: MovingWindowRateLimiter | None = None
        self._tokens: FixedWindowRateLimiter | None = None
        self._last_warning = 0.0
        # Redis's error class once started; a gateway without rate limits never imports redis or limits.
        self._errors: tuple[type[BaseException], ...] = (OSError,)

    def _connect(self) -> None:
        """Build the two limiters on the first limited request, over the shared Redis pool when there is one.

        Tenants (and their limits) can arrive at run time through the admin API, so the
        limiter always exists; a gateway whose tenants have no limits never imports redis.
        """
        from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

        storage: Any
        if self._redis is not None and self._redis.configured:
            from limits.aio.storage import RedisStorage
            from redis.exceptions import RedisError

            self._errors = (RedisError, OSError)
            storage = RedisStorage(
                "async+" + self._redis.url,
                implementation="redispy",
                key_prefix=self.settings.key_prefix,
                # limits types its pass-through options as scalars; redis-py takes the pool object as it is
                connection_pool=self._redis.pool,  # type: ignore[arg-type]
            )
        else:
            from limits.aio.storage import MemoryStorage

            storage = MemoryStorage()
        self._requests = MovingWindowRateLimiter(storage)
        self._tokens = FixedWindowRateLimiter(storage)

    async def aclose(self) -> None:
        """Nothing of its own to close: the Redis pool is the services'."""

    async def admit(self, tenant: TenantConfig) -> None:
        """Take one request slot and check the token and audio budgets; raise :class:`RateLimited` when
        one is spent."""
        if not (tenant.requests_per_minute or tenant.tokens_per_minute or tenant.audio_seconds_per_minute):
            return
        if self._requests is None or self._tokens is None:
            self._connect()
        assert self._requests is not None and self._tokens is not None
        from limits import RateLimitItemPerMinute

        try:
            if tenant.requests_per_minute:
                item = RateLimitItemPerMinute(tenant.requests_per_minute)
                if not await self._requests.hit(item, "requests", tenant.name):
                    stats = await self._requests.get_window_stats(item, "requests", tenant.name)
                    self.metrics.rate_limited.labels("requests").inc()
                    raise RateLimited(
                        f"Rate limit reached for requests per minute (RPM): limit {item.amount}. "
                        f"Please try again in {_wait(stats.reset_time):.0f}s.",
                        retry_after=_wait(stats.reset_time),
                    )
            if tenant.tokens_per_minute:
                item = RateLimitItemPerMinute(tenant.tokens_per_minute)
                if not await self._tokens.test(item, "tokens", tenant.name):
                    stats = await self._tokens.get_window_stats(item, "tokens", tenant.name)
                    self.metrics.rate_limited.labels("tokens").inc()
                    raise RateLimited(
                        f"Rate limit reached for tokens per minute (TPM): limit {item.amount}. "
                        f"Please try again in {_wait(stats.reset_time):.0f}s.",
                        retry_after=_wait(stats.reset_time),
                    )
            if tenant.audio_seconds_per_minute:
                item = RateLimitItemPerMinute(tenant.audio_seconds_per_minute * _MS)
                if not await self._tokens.test(item, "audio", tenant.name):
                    stats = await self._tokens.get_window_stats(item, "audio", tenant.name)
                    self.metrics.rate_limited.labels("audio").inc()
                    raise RateLimited(
                        "Rate limit reached for audio seconds per minute: limit "
                        f"{tenant.audio_seconds_per_minute}. "
                        f"Please try again in {_wait(stats.reset_time):.0f}s.",
                        retry_after=_wait(stats.reset_time),
                    )
        except self._errors as exc:
            self._unreachable(exc)

    async def charge(self, tenant: TenantConfig, tokens: int, *, audio_s: float = 0.0) -> None:
        """Charge what a request used to the budgets its tenant has: its tokens, its seconds of audio."""
        tokens = tokens if tenant.tokens_per_minute else 0
        audio_ms = math.ceil(audio_s * _MS) if tenant.audio_seconds_per_minute else 0
        if tokens <= 0 and audio_ms <= 0:
            return
        if self._tokens is None:
            self._connect()
        assert self._tokens is not None
        from limits import RateLimitItemPerMinute

        try:
            if tenant.tokens_per_minute and tokens > 0:
                await self._tokens.hit(
                    RateLimitItemPerMinute(tenant.tokens_per_minute), "tokens", tenant.name, cost=tokens
                )
            if tenant.audio_seconds_per_minute and audio_ms > 0:
                await self._tokens.hit(
                    RateLimitItemPerMinute(tenant.audio_seconds_per_minute * _MS),
                    "audio",
                    tenant.name,
                    cost=audio_ms,
                )
        except self._errors as exc:
            self._unreachable(exc)

    def _unreachable(self, exc: BaseException) -> None:
        self.metrics.rate_limiter_errors.inc()
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "rate_limiter_unreachable", error=type(exc).__name__, fail_open=self.settings.fail_open
            )
        if not self.settings.fail_open:
            raise Overloaded("rate limits cannot be checked right now", retry_after=1) from exc


def _wait(reset_time: float) -> float:
    return max(1.0, reset_time - time.time())


def check_audio_measured(chain: PolicyChain, tenant: TenantConfig, request: ChatCompletionRequest) -> None:
    """Refuse input audio of a tenant limited in audio seconds per minute where the chain serving it here
    could pass audio on unmeasured (media-limits in shadow mode or failing open), so uncounted. A config's
    tenants and those written or reloaded on this replica were checked against it already; this catches a
    tenant another replica wrote under another config (a rollout), read here from the shared directory."""
    if not tenant.audio_seconds_per_minute or "audio" not in request.input_modalities():
        return
    open_ = [p for p in chain.pre if p.name == "media-limits" and (p.shadow or p.on_error == "fail_open")]
    if open_:
        log.error(
            "tenant_audio_unmeasured",
            tenant=tenant.name,
            policy_set=tenant.policy_set,
            reason="media-limits " + ("in shadow mode" if open_[0].shadow else "with on_error: fail_open"),
        )
        raise GuardUnavailable(
            "audio input is refused for now: this tenant's audio is limited in seconds per minute, and this "
            "gateway cannot measure it under its current configuration; text is served",
            code="audio_limit_unmeasured",
        )
