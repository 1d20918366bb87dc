"""A tenant's audio seconds per minute: checked before a request, charged afterwards with the seconds of
input audio the media steps measured and of speech the answer produced, to a fixed one-minute window an
overdraft blocks until it resets; and a config that could let input audio through unmeasured is refused."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from core.context import MediaRecord, RequestContext
from core.errors import RateLimited
from core.settings import TenantConfig
from gateway.pipeline.record import Finished, tenant_charge
from gateway.ratelimit import RateLimiter
from gateway.settings import Settings
from gateway.traffic_settings import RateLimitSettings
from observability.metrics import Metrics
from policies.settings import PolicyChainConfig, PolicySpec

SPEAKER = TenantConfig(name="speaker", audio_seconds_per_minute=10)


def _limiter() -> tuple[RateLimiter, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return RateLimiter(RateLimitSettings(), metrics), metrics


async def test_an_overdraft_refuses_the_tenant_until_the_window_resets() -> None:
    limiter, metrics = _limiter()
    await limiter.admit(SPEAKER)
    await limiter.charge(SPEAKER, 0, audio_s=6.5)
    await limiter.admit(SPEAKER)  # 6.5 of 10 s used: the next request may still start
    await limiter.charge(SPEAKER, 0, audio_s=4.0)  # charged in full, past the limit
    with pytest.raises(RateLimited) as refused:
        await limiter.admit(SPEAKER)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.message.startswith("Rate limit reached for audio seconds per minute: limit 10. ")
    assert err.retry_after is not None and 1 <= err.retry_after <= 60
    assert metrics.rate_limited.labels("audio")._value.get() == 1
    assert metrics.rate_limited.labels("tokens")._value.get() == 0
    # Another tenant, and the tenant's other limits, are not touched by its audio.
    await limiter.admit(TenantConfig(name="other", audio_seconds_per_minute=10))
    await limiter.admit(TenantConfig(name="speaker", tokens_per_minute=5))


async def test_fractions_of_a_second_add_up() -> None:
    limiter, _ = _limiter()
    tenant = TenantConfig(name="short", audio_seconds_per_minute=1)
    for _ in range(4):
        await limiter.charge(tenant, 0, audio_s=0.24)
    await limiter.admit(tenant)  # 0.96 s
    await limiter.charge(tenant, 0, audio_s=0.05)
    with pytest.raises(RateLimited):
        await limiter.admit(tenant)


async def test_audio_and_tokens_are_charged_to_their_own_budgets() -> None:
    limiter, _ = _limiter()
    both = TenantConfig(name="both", tokens_per_minute=100, audio_seconds_per_minute=10)
    await limiter.charge(both, 150, audio_s=1.0)
    with pytest.raises(RateLimited, match="tokens per minute"):
        await limiter.admit(both)
    limiter, _ = _limiter()
    await limiter.charge(both, 10, audio_s=12.0)
    with pytest.raises(RateLimited, match="audio seconds per minute"):
        await limiter.admit(both)


async def test_a_tenant_without_the_limit_is_never_charged_audio() -> None:
    limiter, _ = _limiter()
    await limiter.charge(TenantConfig(name="free"), 0, audio_s=1e6)
    assert limiter._tokens is None  # nothing connected: no limit, no limiter


def _finished(
    tenant: TenantConfig, *, engine: str | None, media: list[MediaRecord], speech: float
) -> Finished:
    ctx = RequestContext.new("req-1", tenant=tenant.name, tenant_config=tenant)
    ctx.record.outcome = "served" if engine else "refused"
    ctx.record.engine = engine
    ctx.record.audio_seconds = speech
    ctx.outputs.media.extend(media)
    return Finished.of(ctx, client_left=False, audited=False)


def _audio(seconds: float | None, kind: str = "audio") -> MediaRecord:
    return MediaRecord(part="messages.0.content.0", kind=kind, source="data", duration_s=seconds)


def test_the_record_counts_the_input_audio_the_media_steps_measured() -> None:
    f = _finished(
        SPEAKER,
        engine="omni",
        media=[_audio(2.5), _audio(1.25), _audio(30.0, kind="video"), _audio(None)],
        speech=0.0,
    )
    assert f.audio_in_seconds == 3.75


async def test_the_charge_is_the_input_audio_and_the_speech_of_the_answer() -> None:
    limiter, _ = _limiter()
    charged: list[tuple[str, int, float]] = []

    async def charge(tenant: TenantConfig, tokens: int, *, audio_s: float = 0.0) -> None:
        charged.append((tenant.name, tokens, audio_s))

    limiter.charge = charge  # type: ignore[method-assign]
    subscriber = tenant_charge(limiter)
    subscriber(_finished(SPEAKER, engine="omni", media=[_audio(2.5)], speech=1.5))
    # Refused before any engine heard it: the audio was measured, not used.
    subscriber(_finished(SPEAKER, engine=None, media=[_audio(2.5)], speech=0.0))
    subscriber(_finished(TenantConfig(name="free"), engine="omni", media=[_audio(2.5)], speech=1.0))
    await asyncio.sleep(0)
    assert charged == [("speaker", 0, 4.0)]


def _settings(**extra: object) -> Settings:
    return Settings(tenants=[{"name": "speaker", "audio_seconds_per_minute": 60}], **extra)  # type: ignore[arg-type]


def test_the_default_chain_measures_input_audio() -> None:
    # media-limits is a fixed step of every chain: added where it is missing, acting, failing closed.
    _settings()
    _settings(policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]))


def test_a_chain_that_can_pass_audio_unmeasured_is_refused_for_a_tenant_with_the_limit() -> None:
    open_limits = PolicyChainConfig(pre=[PolicySpec(name="media-limits", on_error="fail_open")])
    with pytest.raises(ValidationError, match=r"tenants\[0\]\.audio_seconds_per_minute: .*media-limits"):
        _settings(policies=open_limits)
    with pytest.raises(ValidationError, match=r"policy set 'open'"):
        Settings(
            policy_sets={"open": open_limits},
            tenants=[{"name": "speaker", "policy_set": "open", "audio_seconds_per_minute": 60}],  # type: ignore[list-item]
        )
    # The chain is only refused for a tenant that counts audio.
    Settings(policies=open_limits, tenants=[{"name": "speaker", "tokens_per_minute": 60}])  # type: ignore[list-item]
    Settings(
        policy_sets={"open": open_limits},
        tenants=[{"name": "speaker", "audio_seconds_per_minute": 60}],  # type: ignore[list-item]
    )


def test_the_limit_is_a_whole_number_of_seconds_of_at_least_one() -> None:
    with pytest.raises(ValidationError):
        TenantConfig(name="t", audio_seconds_per_minute=0)
    assert TenantConfig(name="t").audio_seconds_per_minute is None
