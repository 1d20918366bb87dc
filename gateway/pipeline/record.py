"""The one record a finished request leaves: :class:`Finished`, made once and frozen, and the subscribers
it is published to (its engine's outcome window and circuit, the metrics, the access log, the tenant's
token and audio charge, the audit trail).

A subscriber reads the record and nothing else of the request; none of them holds anything the request
must give back (its holdings are released by its exit stack, gateway/pipeline/accounting.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from core.context import MediaRecord, Outcome, PolicyRun, RequestContext
from core.errors import ClientClosedRequest, OmnigateError, Overloaded
from core.settings import TenantConfig
from engines.rollout.signals import ttft_per_1k_prompt_tokens
from observability.audit.log import AuditLog
from observability.audit.record import RequestSnapshot
from observability.metrics import Children, Metrics

if TYPE_CHECKING:
    from engines.selection.pool import EnginePool
    from gateway.ratelimit import RateLimiter

log = structlog.get_logger("omnigate.request")


def outcome_of(error: BaseException | None, degraded: bool) -> tuple[Outcome, int | None, str | None, bool]:
    """How a request ended: its outcome, the status and error code to record (None: as they are), and
    whether the client left."""
    if error is None:
        return ("degraded" if degraded else "served"), None, None, False
    if isinstance(error, ClientClosedRequest):
        # The client left (mid-body) or stopped reading (stalled): cancelled, with the reason named.
        return "cancelled", error.status, error.code, True
    if isinstance(error, OmnigateError):
        # Load refused on purpose (overload, engine busy, audit full) is a refusal, not a failure.
        refused = error.status < 500 or isinstance(error, Overloaded)
        return ("refused" if refused else "failed"), error.status, error.code, False
    if isinstance(error, GeneratorExit) or type(error).__name__ == "CancelledError":
        return "cancelled", None, None, True
    return "failed", 500, "internal_error", False


@dataclass(frozen=True, slots=True)
class Finished:
    """What one request left behind, as its subscribers read it."""

    request_id: str
    tenant: str | None
    tenant_config: TenantConfig | None
    model: str | None
    stream: bool
    engine: str | None
    variant: str | None
    outcome: Outcome
    status: int
    error_code: str | None
    client_left: bool
    attempts: int
    retries: int
    degraded: tuple[str, ...]
    notes: dict[str, Any]
    priority: str | None
    admitted_at_in_flight: int | None
    policy_runs: tuple[PolicyRun, ...]
    #: the client's time to first token: streamed answers only (a whole answer's is its duration)
    ttft_s: float | None
    first_audio_s: float | None
    upstream_ttft_s: float | None
    upstream_e2e_s: float | None
    duration_s: float
    prompt_tokens: int
    completion_tokens: int
    audio_seconds: float
    #: the seconds of the request's input audio parts, as the media steps measured them
    audio_in_seconds: float
    #: what the audit trail encodes (off the request path), None when there is no audit trail
    audit: RequestSnapshot | None
    #: the request's trace when it is sampled: the latency histograms' exemplars link to it
    trace_id: str | None = None
    #: why the served answer ended, as the engine said (None: no answer)
    finish_reason: str | None = None

    @classmethod
    def of(cls, ctx: RequestContext, client_left: bool, audited: bool) -> Finished:
        r, load = ctx.record, ctx.load
        assert r.outcome is not None
        duration = r.elapsed()
        return cls(
            request_id=ctx.identity.request_id,
            tenant=ctx.identity.tenant,
            tenant_config=ctx.identity.tenant_config,
            model=r.public_model,
            stream=r.stream,
            engine=r.engine,
            variant=r.variant,
            outcome=r.outcome,
            status=r.status,
            error_code=r.error_code,
            client_left=client_left,
            attempts=r.attempts,
            retries=r.retries,
            degraded=tuple(ctx.outputs.degraded),
            notes=dict(ctx.outputs.notes),
            priority=load.priority if load is not None else None,
            admitted_at_in_flight=load.in_flight if load is not None else None,
            policy_runs=tuple(r.policy_runs),
            ttft_s=r.ttft_s if r.stream else None,
            first_audio_s=r.first_audio_s if r.stream else None,
            upstream_ttft_s=r.upstream_ttft_s,
            upstream_e2e_s=r.upstream_e2e_s,
            duration_s=duration,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            audio_seconds=r.audio_seconds,
            audio_in_seconds=sum(m.duration_s or 0.0 for m in ctx.outputs.media if m.kind == "audio"),
            audit=RequestSnapshot(ctx, r.received, r.output, r.completion, duration * 1000)
            if audited
            else None,
            trace_id=ctx.trace.trace_id if ctx.trace is not None and ctx.trace.sampled else None,
            finish_reason=r.finish_reason,
        )

    @property
    def served(self) -> bool:
        return self.outcome in ("served", "degraded")

    def traced(self, media: list[MediaRecord]) -> dict[str, Any]:
        """What the request's span says of it (observability/tracing.py ``RequestTrace.finished``), with
        its input media counted by modality: images, videos and their frames, audio seconds, their tokens."""
        out = {name: getattr(self, name) for name in _TRACED}
        counts: dict[str, float] = {}
        for m in media:
            key = {"image": "images", "video": "videos", "audio": "audio_parts"}.get(m.kind, m.kind)
            counts[key] = counts.get(key, 0) + 1
            if m.kind == "video" and m.frames:
                counts["video_frames"] = counts.get("video_frames", 0) + m.frames
            if m.kind == "audio" and m.duration_s:
                counts["audio_seconds"] = round(counts.get("audio_seconds", 0) + m.duration_s, 3)
            if m.modal_tokens:
                counts["media_tokens"] = counts.get("media_tokens", 0) + m.modal_tokens
        out["modalities"] = counts
        return out


_TRACED = (
    "model", "stream", "engine", "variant", "tenant", "outcome", "status", "error_code", "attempts",
    "retries", "ttft_s", "prompt_tokens", "completion_tokens", "audio_seconds", "finish_reason",
)  # fmt: skip


#: a subscriber: called once with every finished request, in the order they are listed
Subscriber = Callable[[Finished], None]


def engine_outcome(pool: EnginePool) -> Subscriber:
    """A served request's latencies for its engine's window and circuit (one report per request)."""

    def report(f: Finished) -> None:
        if f.engine is not None and f.served:
            pool.report_success(
                f.engine,
                f.ttft_s,
                f.first_audio_s,
                f.duration_s,
                f.upstream_ttft_s,
                f.upstream_e2e_s,
                f.completion_tokens,
                f.audio_seconds,
                prompt_tokens=f.prompt_tokens,
                tenant=f.tenant,
            )

    return report


def observe(m: Metrics, pool: EnginePool) -> Subscriber:
    """The request's metrics, observed once."""
    floor = pool.routing.signals.prompt_tokens_floor
    requests, degradations, duration = Children(m.requests), Children(m.degradations), Children(m.duration)
    ttft, first_audio, upstream_ttft = Children(m.ttft), Children(m.first_audio), Children(m.upstream_ttft)
    per_1k, upstream_duration = Children(m.upstream_ttft_per_1k), Children(m.upstream_duration)
    audio_output = Children(m.audio_output)

    def record(f: Finished) -> None:
        requests(f.model or "unknown", f.outcome).inc()
        if f.client_left:
            m.client_disconnects.inc()
        for reason in f.degraded:
            degradations(reason).inc()
        engine, variant = f.engine or "none", f.variant or "none"
        stream = "true" if f.stream else "false"
        # A sampled trace is the exemplar of the bucket the request fell in (OpenMetrics scrapes show it).
        exemplar = {"trace_id": f.trace_id} if f.trace_id is not None else None
        duration(engine, variant, f.outcome, stream).observe(f.duration_s, exemplar)
        if f.engine is None:
            return
        if f.ttft_s is not None:
            ttft(engine, variant).observe(f.ttft_s, exemplar)
        if f.first_audio_s is not None:
            first_audio(engine, variant).observe(f.first_audio_s)
        if f.upstream_ttft_s is not None:
            upstream_ttft(engine, variant).observe(f.upstream_ttft_s)
            normalised = ttft_per_1k_prompt_tokens(f.upstream_ttft_s, f.prompt_tokens, floor)
            if normalised is not None and f.served:
                per_1k(engine, variant, f.model or "unknown").observe(normalised)
        if f.upstream_e2e_s is not None:
            upstream_duration(engine, variant, stream).observe(f.upstream_e2e_s)
        if f.audio_seconds:
            audio_output(engine, variant).inc(f.audio_seconds)

    return record


def access_log(f: Finished) -> None:
    """The access log's one line per request (``request_finished``)."""
    log.info(
        "request_finished",
        tenant=f.tenant,
        model=f.model,
        stream=f.stream,
        engine=f.engine,
        variant=f.variant,
        outcome=f.outcome,
        status=f.status,
        error_code=f.error_code,
        attempts=f.attempts,
        retries=f.retries,
        degraded=list(f.degraded) or None,
        priority=f.priority,
        admitted_at_in_flight=f.admitted_at_in_flight,
        policies=[(p.name, p.verdict) for p in f.policy_runs] or None,
        attempt_log=[
            {"attempt": p.attempt, "policy": p.name, "verdict": p.verdict, "score": p.score}
            for p in f.policy_runs
            if p.stage == "post"
        ]
        or None,
        notes=f.notes or None,
        ttft_ms=round(f.ttft_s * 1000, 2) if f.ttft_s is not None else None,
        duration_ms=round(f.duration_s * 1000, 2),
        prompt_tokens=f.prompt_tokens,
        completion_tokens=f.completion_tokens,
    )


def tenant_charge(limiter: RateLimiter) -> Subscriber:
    """What the request used, charged to its tenant's per-minute budgets (in the background): its tokens,
    and its seconds of audio (the input audio an engine was sent, the speech of the answer)."""
    background: set[asyncio.Task[None]] = set()

    def charge(f: Finished) -> None:
        tenant = f.tenant_config
        if tenant is None:
            return
        used = f.prompt_tokens + f.completion_tokens if tenant.tokens_per_minute else 0
        # Input audio measured for a request refused before any engine (a guard, a budget) was not used.
        heard = f.audio_in_seconds if f.engine is not None else 0.0
        audio = heard + f.audio_seconds if tenant.audio_seconds_per_minute else 0.0
        if used or audio:
            task = asyncio.get_running_loop().create_task(limiter.charge(tenant, used, audio_s=audio))
            background.add(task)
            task.add_done_callback(background.discard)

    return charge


def audit_submit(audit: AuditLog, f: Finished) -> asyncio.Future[int] | None:
    """The record handed to the audit trail; the future its commit resolves (the durability to await)."""
    if f.audit is None:
        return None
    return audit.submit("request", request_id=f.request_id, tenant=f.tenant, snapshot=f.audit)
