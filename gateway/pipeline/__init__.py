"""How one chat completion request is served, top to bottom; a newcomer starts here.

    admission (audit room, tenant rate limits, model access, a concurrency slot: gateway/admission.py)
      → pre-policies (the tenant's chain; load-shedding first)                  this file, prepare.py
      → engine choice → first upstream chunk (failover point)                   attempt.py (engines/selection/choice.py)
      → stream filters → streaming post-checks → first released batch (commit)  relay.py, stream.py
      → post-policies (retry while nothing was sent)                            stream.py, complete.py, verdicts.py
      → one record, published to its subscribers (the audit committed before
        the response is complete)                                               accounting.py, record.py

Nothing here knows about HTTP: the transport renders what :meth:`Pipeline.stream`
and :meth:`Pipeline.complete` return. Both run the one attempt loop
(:class:`gateway.pipeline.attempt.Attempts`): before the first upstream chunk a failing
engine is replaced by the next one, each try holding a lease on its engine slot that is
settled exactly once. :meth:`Pipeline.stream` returns only once the first chunk is
*released* to the client (or the stream ended), so everything a held-back check decides
before that (a retry, a refusal, a header such as ``x-omnigate-grounding``) still shapes
the HTTP response; after it, a failure ends the stream with an error frame.

A segmented input (a :class:`core.context.SegmentPlan` a pre-policy returned with the request it
rewrote, for audio too long for one call) is served as one engine call per segment
(gateway/pipeline/segments.py).

The transport runs each request inside :meth:`Pipeline.lifetime`, the request's own exit stack: what
the request holds (``ctx.holds``) is released when it closes and a request nobody accounted for gets
its record there, whatever ended it (the client gone mid-body or mid-stream, a server error, a
cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from core.context import RequestContext, SegmentPlan
from core.errors import InvalidRequest, ModelNotFound, OmnigateError
from core.schemas import ChatCompletionRequest
from engines.rollout.energy import EnergyBook
from engines.selection.pool import EnginePool
from gateway.answer_audio import AnswerAudio, MemoryAnswers
from gateway.chains import Chains, ChainSet
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.attempt import Attempt, Attempts, first_chunk
from gateway.pipeline.complete import CompletionResult, run_complete
from gateway.pipeline.prepare import let_go_of_media, run_pre
from gateway.pipeline.relay import Relay
from gateway.pipeline.segments import segmented
from gateway.pipeline.stream import ResponseStream, run_stream
from gateway.ratelimit import RateLimiter, check_audio_measured
from gateway.speech import check_speech
from observability.audit.log import AuditLog
from observability.metrics import Metrics
from observability.tracing import Tracing
from policies.base import Segmented
from policies.registry import PolicyChain

if TYPE_CHECKING:
    from gateway.admission import AdmissionGate

__all__ = ["Attempt", "CompletionResult", "Pipeline", "ResponseStream"]

log = structlog.get_logger("omnigate.request")


class Pipeline:
    def __init__(
        self,
        pool: EnginePool,
        policies: Chains | PolicyChain,
        metrics: Metrics,
        *,
        audit: AuditLog | None = None,
        limiter: RateLimiter | None = None,
        sentinel: Any = None,
        admission: AdmissionGate | None = None,
        sampling_defaults: dict[str, dict[str, Any]] | None = None,
        energy: EnergyBook | None = None,
        answers: AnswerAudio | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.pool = pool
        #: OpenTelemetry traces (observability/tracing.py); None: off, and requests carry no trace
        self.tracing = tracing
        #: spoken answers a client may send back by their audio id (gateway/answer_audio.py)
        self.answers = answers if answers is not None else AnswerAudio(MemoryAnswers())
        #: the chain generation new requests take (gateway/chains.py); a bare chain: one generation of it
        self.policies = policies if isinstance(policies, Chains) else Chains(ChainSet(policies))
        self.metrics = metrics
        self.limiter = limiter
        #: per public model, the sampling parameters a request that sets none of its own is served with
        self.sampling_defaults: dict[str, dict[str, Any]] = sampling_defaults or {}
        #: the collaborators, each handed what it uses (they keep nothing of a request)
        self.accounting = Accounting(
            pool, metrics, audit=audit, limiter=limiter, sentinel=sentinel, admission=admission, energy=energy
        )
        self.attempts = Attempts(pool, metrics)
        self.relay = Relay(pool, metrics, self.accounting)

    # what the accounting uses, under the names the services and tests read
    @property
    def audit(self) -> AuditLog | None:
        return self.accounting.audit

    @property
    def admission(self) -> AdmissionGate | None:
        """The admission gate (gateway/admission.py); None: traffic control is off."""
        return self.accounting.admission

    @property
    def sentinel(self) -> Any:
        """The accuracy sentinel (``offer(engine, variant, completion)``), or None."""
        return self.accounting.sentinel

    @property
    def energy(self) -> EnergyBook | None:
        """The engines' joules per token (engines/rollout/energy.py), for usage.energy_joules; None: not estimated."""
        return self.accounting.energy

    @property
    def chain(self) -> PolicyChain:
        """The current default chain (what new requests without a policy set run)."""
        return self.policies.current.chain

    @property
    def chains(self) -> dict[str, PolicyChain]:
        """The current tenant policy sets by name; a tenant without one gets ``chain``."""
        return self.policies.current.sets

    def chain_for(self, ctx: RequestContext) -> PolicyChain:
        # The generation the request began on, to its end: a reload meanwhile does not move it.
        # The context holds it as a lease (core knows no chains); the pipeline put it there, so it is a ChainSet.
        generation = ctx.policies if isinstance(ctx.policies, ChainSet) else self.policies.current
        return generation.for_set(ctx.identity.policy_set)

    # -- the two entry points ----------------------------------------------
    async def stream(self, request: ChatCompletionRequest, ctx: RequestContext) -> ResponseStream:
        """Run everything up to the first upstream chunk; raise before committing."""
        self._begin(ctx, request)
        async with self.accounting.settling(ctx):  # cancellation included: every request accounted for once
            prepared = self._prepare(request, ctx)
            del request  # the media steps replace its parts: nothing here may keep the client's strings alive
            request, plan = await prepared
            attempt = await self.open_attempt(request, ctx)
        rs = ResponseStream(self, attempt.request, ctx, attempt, plan)
        await rs._prime()  # the stream's own teardown accounts for errors from here on
        return rs

    async def complete(self, request: ChatCompletionRequest, ctx: RequestContext) -> CompletionResult:
        self._begin(ctx, request)
        async with self.accounting.settling(ctx):  # as in stream
            prepared = self._prepare(request, ctx)
            del request  # as in stream
            request, plan = await prepared
            result = await run_complete(self, request, plan, ctx)
        ctx.record.completion = result.completion
        if result.request.wants_audio and result.completion.audio:
            completion = result.completion
            await self.answers.remember(
                ctx.identity.request_id, completion.transcript or completion.text, ctx.identity.tenant
            )
        await self.accounting.settle(ctx, None)
        return result

    @contextlib.asynccontextmanager
    async def lifetime(self, ctx: RequestContext) -> AsyncIterator[contextlib.AsyncExitStack]:
        """The request's own exit stack, from admission to the end of its response.

        It holds the request's holdings (``ctx.holds``: admission slot, tenant quota, chain generation,
        engine slot, media budget, in-flight count), released when it closes however the request ended;
        before them, a request that ends by an exception nobody accounted for (the client gone
        mid-body, a cancellation, a server error) is accounted for with it, so it still leaves one
        record. The transport enters what must end with the response on the stack it yields (the open
        response stream), which closes first.
        """
        self.accounting.open(ctx)
        with ctx.holds:  # released last, whatever happened above them
            # The stack closes first (the open response stream), then a request it ended is accounted for.
            async with self.accounting.settling(ctx), contextlib.AsyncExitStack() as stack:
                yield stack
            if ctx.record.outcome is None:
                log.error("request_unaccounted")
                await self.accounting.settle(ctx, RuntimeError("the request ended unaccounted for"))

    @contextlib.contextmanager
    def traced(self, ctx: RequestContext, headers: Mapping[str, str]) -> Iterator[None]:
        """The request's trace while the block runs (tracing on): its ids on every log line of the request."""
        if self.tracing is None:
            yield
            return
        trace = ctx.trace = self.tracing.start(headers, ctx.identity.request_id)
        structlog.contextvars.bind_contextvars(trace_id=trace.trace_id, span_id=trace.span_id)
        try:
            yield
        finally:
            trace.end()

    async def admit(self, ctx: RequestContext) -> None:
        """Take the request's admission slot, once; the transport calls it before reading the body, so a
        request admission refuses costs neither its body nor any media work. Held until it ends: it is
        one of the request's holdings (``ctx.holds``)."""
        if self.admission is None or ctx.admission is not None:
            return
        started, outcome = time.perf_counter(), "cancelled"
        try:
            ctx.admission = await self.admission.admit(ctx)
            outcome = "admitted"
        except OmnigateError as exc:
            outcome = exc.code or "refused"
            raise
        finally:
            if ctx.trace is not None:
                ctx.trace.admission(time.perf_counter() - started, outcome, ctx.load)

    async def refused(self, ctx: RequestContext, error: OmnigateError) -> None:
        """A request the transport refused before the pipeline (its key, its body): counted and audited."""
        self.accounting.open(ctx)
        await self.accounting.settle(ctx, error)

    # -- admission and pre-policies -----------------------------------------
    def _begin(self, ctx: RequestContext, request: ChatCompletionRequest) -> None:
        ctx.record.public_model = request.model if self.pool.serves(request.model) else None
        ctx.record.stream = request.stream
        ctx.record.received = request
        ctx.policies = self.policies.current.acquire()  # a holding: let go when the request's holds close
        self.accounting.open(ctx)

    async def _prepare(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> tuple[ChatCompletionRequest, SegmentPlan | None]:
        """The request as the pre-policies left it, and the segment plan one of them returned with it."""
        if self.audit is not None:
            self.audit.admit()
        tenant = ctx.identity.tenant_config
        if tenant is not None and self.limiter is not None:
            await self.limiter.admit(tenant)
        if not self.pool.serves(request.model) or (
            tenant is not None and tenant.models is not None and request.model not in tenant.models
        ):
            raise ModelNotFound(
                f"the model {request.model!r} does not exist or you do not have access to it", param="model"
            )
        check_speech(request, [e for e in self.pool.engines.values() if request.model in e.config.serves])
        await self.admit(ctx)
        request = await self.answers.resolve(request, ctx.identity.tenant)
        defaults = self.sampling_defaults.get(request.model)
        if defaults:
            # Each default fills only a parameter the client left unset; what was filled is audited.
            applied = {k: v for k, v in defaults.items() if getattr(request, k) is None}
            if applied:
                request = request.model_copy(update=applied)
                ctx.record.sampling_defaults = applied
        chain = self.chain_for(ctx)
        if tenant is not None:
            check_audio_measured(chain, tenant, request)
        if request.choices > 1 and (chain.post or chain.stream):
            # Post-policies and stream filters judge and retry one answer; n answers would pass unjudged.
            raise InvalidRequest(
                "n > 1 is not available for this model: its answers are checked one at a time", param="n"
            )
        digests: asyncio.Future[Any] | None = None
        plan: SegmentPlan | None = None
        media_seen = False
        for policy in chain.pre:
            if type(policy.impl).media_only:
                if not request.input_modalities() - {"text"}:
                    continue  # a media step has nothing to do on a text-only request: not run, not recorded
                if not media_seen:
                    media_seen, digests = True, let_go_of_media(ctx, self.audit is not None)
            out = await run_pre(policy, request, ctx, self.accounting.policy_ran)
            request, plan = (out.request, out.plan) if isinstance(out, Segmented) else (out, plan)
        if digests is not None:
            await digests  # made, so the client's strings are gone before the engine is called
        if segmented(plan):
            assert plan is not None
            ctx.record.segments = list(plan.boundaries)
        return request, plan

    # -- the engine calls (the one attempt loop) ------------------------------
    async def open_attempt(self, request: ChatCompletionRequest, ctx: RequestContext) -> Attempt:
        """The stream path's attempt: engines in order until one yields its first chunk."""
        answered = await self.attempts.call(request, ctx, first_chunk)
        upstream, first = answered.result
        # The engine's own time to first token: no body read, pre-policy, slot wait or hold-back in it.
        ctx.record.upstream_ttft_s, ctx.record.upstream_e2e_s = time.perf_counter() - answered.sent, None
        return Attempt(answered.engine, answered.request, upstream, first, answered.sent)

    # -- names older callers and tests reach for -------------------------------
    def _engines_for(self, request: ChatCompletionRequest) -> list[Any]:
        return self.attempts.engines_for(request)

    def _finish(self, ctx: RequestContext, error: BaseException | None) -> asyncio.Future[int] | None:
        return self.accounting.finish(ctx, error)

    def _run_stream(self, rs: ResponseStream) -> Any:
        return run_stream(self, rs)
