"""What a request leaves behind: its metrics, its access log event (``request_finished``), its tenant's
token charge and its audit record, made once per request in :meth:`Accounting.finish`. It settles the
engine slot with the request's outcome and then closes the request's holdings (``ctx.holds``: admission
slot, media budget, chain generation, in-flight count) at once; that stack closes anyway when the
request's lifetime ends (``Pipeline.lifetime``), so no release depends on this being called.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog

from core.context import PolicyRun, RequestContext
from core.errors import ClientClosedRequest, EngineError, OmnigateError, Overloaded
from core.events import Completion
from engines.rollout.energy import EnergyBook
from engines.rollout.signals import ttft_per_1k_prompt_tokens
from engines.selection.pool import EnginePool
from gateway.ratelimit import RateLimiter
from observability.audit.log import AuditLog
from observability.audit.record import RequestSnapshot
from observability.metrics import Metrics
from policies.registry import LoadedPolicy

if TYPE_CHECKING:
    from gateway.admission import AdmissionGate

log = structlog.get_logger("omnigate.request")


class Accounting:
    def __init__(
        self,
        pool: EnginePool,
        metrics: Metrics,
        *,
        audit: AuditLog | None,
        limiter: RateLimiter | None,
        sentinel: Any,
        admission: AdmissionGate | None,
        energy: EnergyBook | None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.audit = audit
        self.limiter = limiter
        #: the accuracy sentinel (``offer(engine, variant, completion)``), or None
        self.sentinel = sentinel
        #: the admission gate (gateway/admission.py); None: traffic control is off
        self.admission = admission
        #: the engines' joules per token (engines/energy.py), for usage.energy_joules; None: not estimated
        self.energy = energy
        self._background: set[asyncio.Task[None]] = set()

    def policy_ran(
        self,
        policy: LoadedPolicy,
        ctx: RequestContext,
        verdict: str,
        seconds: float,
        detail: str | None,
        score: float | None = None,
    ) -> None:
        """One policy that ran: on the request's record and in the decision metrics."""
        ctx.record.policy_runs.append(
            PolicyRun(
                policy.name,
                policy.stage,
                verdict,
                seconds * 1000,
                policy.shadow,
                detail,
                ctx.record.retries + 1,
                score,
            )
        )
        shadow = str(policy.shadow).lower()
        self.metrics.policy_decisions.labels(policy.name, policy.stage, verdict, shadow).inc()
        self.metrics.policy_duration.labels(policy.name, policy.stage).observe(seconds)

    def account(self, ctx: RequestContext, completion: Completion) -> None:
        """The served answer's usage, speech seconds, energy; the sentinel may sample its audio."""
        ctx.record.prompt_tokens = completion.usage.prompt_tokens
        ctx.record.completion_tokens = completion.usage.completion_tokens
        if completion.audio and completion.sample_rate:
            ctx.record.audio_seconds = len(completion.audio) / (
                2 * completion.channels * completion.sample_rate
            )
        if completion.audio and self.sentinel is not None and ctx.record.engine is not None:
            self.sentinel.offer(
                ctx.record.engine,
                ctx.record.variant,
                completion,
                model=ctx.record.public_model,
                tenant=ctx.identity.tenant,
            )
        if self.energy is not None:
            ctx.record.energy_joules = self.energy.estimate(
                ctx.record.engine, ctx.record.completion_tokens, ctx.record.audio_seconds
            )

    def open(self, ctx: RequestContext) -> None:
        """Count the request in flight, once; the count is one of its holdings, given back with them."""
        if not ctx.counted:
            ctx.counted = True
            self.metrics.in_flight.inc()
            ctx.holds.callback(self.metrics.in_flight.dec)

    async def settle(self, ctx: RequestContext, error: BaseException | None) -> None:
        await self.durable(ctx, self.finish(ctx, error))

    async def durable(self, ctx: RequestContext, fut: asyncio.Future[int] | None) -> None:
        """Unless the client left, wait (at most ``audit.ack_timeout_s``) for the audit record's commit."""
        if fut is not None and self.audit is not None and ctx.record.outcome != "cancelled":
            await self.audit.wait(fut)

    def finish(self, ctx: RequestContext, error: BaseException | None) -> asyncio.Future[int] | None:
        """Account for the request, give back what it holds and hand its record to the audit; once per
        request (a second call finds it accounted for and does nothing)."""
        if ctx.record.outcome is not None:
            return None
        lease, ctx.lease = ctx.lease, None
        if ctx.record.engine is not None and error is None:
            # One report per request (never per chunk): latency and outcome for its window and circuit.
            self.pool.report_success(
                ctx.record.engine,
                self._ttft(ctx),
                ctx.record.first_audio_s if ctx.record.stream else None,
                ctx.record.elapsed(),
                ctx.record.upstream_ttft_s,
                ctx.record.upstream_e2e_s,
                ctx.record.completion_tokens,
                ctx.record.audio_seconds,
                prompt_tokens=ctx.record.prompt_tokens,
                tenant=ctx.identity.tenant,
            )
        if lease is not None:
            lease.settle(reported=error is None or isinstance(error, EngineError))
        if self.admission is not None:
            self.admission.finished(ctx)
        # Everything else it holds goes back now (the last request of a reloaded-away chain generation
        # closes it); the lifetime's own close of the stack then finds nothing left.
        try:
            ctx.holds.close()
        except Exception as exc:  # every release has run; the record is still owed
            log.error("request_release_failed", exc_info=exc)
        if error is None:
            ctx.record.outcome = "degraded" if ctx.outputs.degraded else "served"
        elif isinstance(error, ClientClosedRequest):
            # The client left (mid-body) or stopped reading (stalled): cancelled, with the reason named.
            ctx.record.outcome, ctx.record.status, ctx.record.error_code = (
                "cancelled",
                error.status,
                error.code,
            )
            self.metrics.client_disconnects.inc()
        elif isinstance(error, OmnigateError):
            ctx.record.status = error.status
            ctx.record.error_code = error.code
            # Load refused on purpose (overload, engine busy, audit full) is a refusal, not a failure.
            refused = error.status < 500 or isinstance(error, Overloaded)
            ctx.record.outcome = "refused" if refused else "failed"
        elif isinstance(error, GeneratorExit) or type(error).__name__ == "CancelledError":
            ctx.record.outcome = "cancelled"
            self.metrics.client_disconnects.inc()
        else:
            ctx.record.outcome, ctx.record.status, ctx.record.error_code = "failed", 500, "internal_error"
        self._observe(ctx)
        self._log(ctx)
        tenant = ctx.identity.tenant_config
        if tenant is not None and tenant.tokens_per_minute and self.limiter is not None:
            used = ctx.record.prompt_tokens + ctx.record.completion_tokens
            if used:
                task = asyncio.get_running_loop().create_task(self.limiter.charge(tenant, used))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if self.audit is None:
            return None
        snapshot = RequestSnapshot(
            ctx, ctx.record.received, ctx.record.output, ctx.record.completion, ctx.record.elapsed() * 1000
        )
        return self.audit.submit(
            "request", request_id=ctx.identity.request_id, tenant=ctx.identity.tenant, snapshot=snapshot
        )

    def _observe(self, ctx: RequestContext) -> None:
        m = self.metrics
        assert ctx.record.outcome is not None
        m.requests.labels(ctx.record.public_model or "unknown", ctx.record.outcome).inc()
        for reason in ctx.outputs.degraded:
            m.degradations.labels(reason).inc()
        engine, variant = ctx.record.engine or "none", ctx.record.variant or "none"
        stream = str(ctx.record.stream).lower()
        m.duration.labels(engine, variant, ctx.record.outcome, stream).observe(ctx.record.elapsed())
        ttft = self._ttft(ctx)
        if ttft is not None and ctx.record.engine:
            m.ttft.labels(engine, variant).observe(ttft)
        if ctx.record.first_audio_s is not None and ctx.record.stream and ctx.record.engine:
            m.first_audio.labels(engine, variant).observe(ctx.record.first_audio_s)
        if ctx.record.upstream_ttft_s is not None and ctx.record.engine:
            m.upstream_ttft.labels(engine, variant).observe(ctx.record.upstream_ttft_s)
            per_1k = ttft_per_1k_prompt_tokens(
                ctx.record.upstream_ttft_s,
                ctx.record.prompt_tokens,
                self.pool.routing.signals.prompt_tokens_floor,
            )
            if per_1k is not None and ctx.record.outcome in ("served", "degraded"):
                model = ctx.record.public_model or "unknown"
                m.upstream_ttft_per_1k.labels(engine, variant, model).observe(per_1k)
        if ctx.record.upstream_e2e_s is not None and ctx.record.engine:
            m.upstream_duration.labels(engine, variant, str(ctx.record.stream).lower()).observe(
                ctx.record.upstream_e2e_s
            )
        if ctx.record.audio_seconds and ctx.record.engine:
            m.audio_output.labels(engine, variant).inc(ctx.record.audio_seconds)

    @staticmethod
    def _ttft(ctx: RequestContext) -> float | None:
        """The client's time to first token: streamed answers only. A whole answer reaches its client at
        once, at its end; that is its duration (``omnigate_request_duration_seconds``), and taken for a
        first token it made a long answer from an idle engine look like a queue."""
        return ctx.record.ttft_s if ctx.record.stream else None

    @classmethod
    def _log(cls, ctx: RequestContext) -> None:
        log.info(
            "request_finished",
            tenant=ctx.identity.tenant,
            model=ctx.record.public_model,
            stream=ctx.record.stream,
            engine=ctx.record.engine,
            variant=ctx.record.variant,
            outcome=ctx.record.outcome,
            status=ctx.record.status,
            error_code=ctx.record.error_code,
            attempts=ctx.record.attempts,
            retries=ctx.record.retries,
            degraded=ctx.outputs.degraded or None,
            priority=ctx.load.priority if ctx.load is not None else None,
            admitted_at_in_flight=ctx.load.in_flight if ctx.load is not None else None,
            policies=[(p.name, p.verdict) for p in ctx.record.policy_runs] or None,
            attempt_log=[
                {"attempt": p.attempt, "policy": p.name, "verdict": p.verdict, "score": p.score}
                for p in ctx.record.policy_runs
                if p.stage == "post"
            ]
            or None,
            notes=ctx.outputs.notes or None,
            ttft_ms=round(ttft * 1000, 2) if (ttft := cls._ttft(ctx)) is not None else None,
            duration_ms=round(ctx.record.elapsed() * 1000, 2),
            prompt_tokens=ctx.record.prompt_tokens,
            completion_tokens=ctx.record.completion_tokens,
        )
