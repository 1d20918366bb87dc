"""What a request leaves behind, made once in :meth:`Accounting.finish`: its one frozen record
(gateway/pipeline/record.py), published to its subscribers (engine outcome, metrics, access log, tenant
charge, audit trail). Before publishing it settles the engine slot with the request's outcome and closes
the request's holdings (``ctx.holds``: admission slot, media budget, chain generation, in-flight count);
that stack closes anyway when the request's lifetime ends (``Pipeline.lifetime``), so no release depends
on this being called.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog

from core.context import PolicyRun, RequestContext
from core.errors import EngineError
from core.events import Completion, Usage
from engines.rollout.energy import EnergyBook
from engines.selection.pool import EnginePool
from gateway.pipeline.record import (
    Finished,
    Subscriber,
    access_log,
    audit_submit,
    engine_outcome,
    observe,
    outcome_of,
    tenant_charge,
)
from gateway.ratelimit import RateLimiter
from observability.audit.log import AuditLog
from observability.metrics import Children, Metrics
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
        #: the engines' joules per token (engines/rollout/energy.py), for usage.energy_joules; None: not estimated
        self.energy = energy
        self._engine_outcome = engine_outcome(pool)
        self._decisions, self._policy_duration = (
            Children(metrics.policy_decisions),
            Children(metrics.policy_duration),
        )
        self._endpoints = Children(metrics.endpoint_requests)
        #: what every finished request's record is published to, in order (the audit last: it is awaited)
        self._subscribers: list[Subscriber] = [observe(metrics, pool), access_log]
        if limiter is not None:
            self._subscribers.append(tenant_charge(limiter))

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
        if ctx.trace is not None:
            ctx.trace.policy(
                policy.name,
                policy.stage,
                verdict,
                seconds,
                shadow=policy.shadow,
                score=score,
                attempt=ctx.record.retries + 1,
            )
        shadow = "true" if policy.shadow else "false"
        self._decisions(policy.name, policy.stage, verdict, shadow).inc()
        self._policy_duration(policy.name, policy.stage).observe(seconds)

    def account(self, ctx: RequestContext, completion: Completion) -> None:
        """The served answer's usage, speech seconds, energy; the sentinel may sample its audio."""
        ctx.record.finish_reason = completion.finish_reason
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

    def account_cut(self, ctx: RequestContext, completion: Completion) -> None:
        """An answer cut before the engine's usage came (the client left, the engine failed mid-stream) is
        still counted: its speech seconds, and its pieces as its tokens, marked as the gateway's count."""
        if ctx.record.completion_tokens or not completion.pieces:
            return
        if not completion.usage.completion_tokens:
            completion.usage = Usage(completion.usage.prompt_tokens, completion.pieces)
            ctx.record.usage_counted_by = "gateway"
        self.account(ctx, completion)

    def open(self, ctx: RequestContext) -> None:
        """Count the request in flight, once; the count is one of its holdings, given back with them."""
        if not ctx.counted:
            ctx.counted = True
            self.metrics.in_flight.inc()
            ctx.holds.callback(self.metrics.in_flight.dec)

    async def settle(self, ctx: RequestContext, error: BaseException | None) -> None:
        await self.durable(ctx, self.finish(ctx, error))

    def settling(self, ctx: RequestContext) -> Settling:
        """``async with accounting.settling(ctx):`` a block that ends by an exception accounts for the
        request with it (once), and the exception goes on."""
        return Settling(self, ctx)

    async def durable(self, ctx: RequestContext, fut: asyncio.Future[int] | None) -> None:
        """Unless the client left, wait (at most ``audit.ack_timeout_s``) for the audit record's commit."""
        if fut is None or self.audit is None or ctx.record.outcome == "cancelled":
            return
        if ctx.trace is None:
            await self.audit.wait(fut)
            return
        started, seq, error = time.perf_counter(), None, None
        try:
            seq = await self.audit.wait(fut)
        except Exception as exc:
            error = exc
            raise
        finally:
            ctx.trace.audit(time.perf_counter() - started, seq, error)

    def finish(self, ctx: RequestContext, error: BaseException | None) -> asyncio.Future[int] | None:
        """Account for the request once (a second call finds it accounted for and does nothing): its one
        record is made, what it holds is given back, and the record is published to its subscribers; the
        audit's commit is returned, for the durability the route awaits."""
        r = ctx.record
        if r.outcome is not None:
            return None
        outcome, status, code, left = outcome_of(error, bool(ctx.outputs.degraded))
        r.outcome = outcome
        if status is not None:
            r.status, r.error_code = status, code
        finished = Finished.of(ctx, left, audited=self.audit is not None)
        # The engine's window hears of a served request before its slot is settled (a half-open trial's
        # verdict comes with it).
        self._engine_outcome(finished)
        lease, ctx.lease = ctx.lease, None
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
        if ctx.trace is not None:
            ctx.trace.finished(finished.traced(ctx.outputs.media))
        self._endpoints(endpoint_of(ctx), outcome).inc()
        for subscriber in self._subscribers:
            subscriber(finished)
        return audit_submit(self.audit, finished) if self.audit is not None else None


def endpoint_of(ctx: RequestContext) -> str:
    """The endpoint a request came to: a realtime session's response, an audio route (its notes name it),
    else chat (the label of ``omnigate_endpoint_requests_total``, from this bounded set)."""
    if ctx.record.realtime is not None:
        return "realtime"
    audio = ctx.outputs.notes.get("audio")
    endpoint = audio.get("endpoint") if isinstance(audio, dict) else None
    return endpoint if endpoint in ("transcriptions", "speech") else "chat"


class Outcome:
    """What ended a block: the exception it raised (any: a cancellation, a client gone, ``GeneratorExit``
    included), or None. It records and never handles: the exception goes on."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def __enter__(self) -> Outcome:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.error = exc


class Settling:
    """The request accounted for with whatever exception ends the block (see :meth:`Accounting.settling`)."""

    __slots__ = ("_accounting", "_ctx")

    def __init__(self, accounting: Accounting, ctx: RequestContext) -> None:
        self._accounting, self._ctx = accounting, ctx

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            await self._accounting.settle(self._ctx, exc)  # nothing to do when it already was
