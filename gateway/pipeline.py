"""How one chat completion request is served, top to bottom.

    admission (audit room, tenant rate limits, model access, a concurrency slot: gateway/admission.py)
      → pre-policies (the tenant's chain; load-shedding first)
      → engine choice → first upstream chunk (failover point) → stream filters
      → streaming post-checks → first released chunk (commit point)
      → post-policies (retry while nothing was sent) → accounting → audit record
      (committed before the response is complete)

Nothing here knows about HTTP: the transport renders what :meth:`Pipeline.stream`
and :meth:`Pipeline.complete` return. Before the first upstream chunk a failing
engine is replaced by the next one. :meth:`Pipeline.stream` returns only once the
first chunk is *released* to the client (or the stream ended), so everything a
held-back check decides before that (a retry, a refusal, a header such as
``x-omnigate-grounding``) still shapes the HTTP response; after it, a failure
ends the stream with an error frame.

A segmented input (``ctx.segmentation``, set by a pre-policy for audio too long
for one call) is served as one engine call per segment, in order, concatenated
into one response: the first segment's first chunk is the commit point; later
segments may still fail over before their own first chunk; only the last
segment's ``finish_reason`` is released and usage is summed.

Its length: the JSON and stream paths still have an attempt loop each; folding them into one loop with
the relay and the accounting beside it is the planned restructuring (issue: one kernel, one request loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import structlog
from core.events import Completion, Delta, Usage

from core.context import RequestContext
from core.errors import (
    AnswerWithheld,
    EngineError,
    EngineProtocolError,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    OmnigateError,
    Overloaded,
)
from core.schemas import ChatCompletionRequest
from engines.base import Engine
from engines.energy import EnergyBook
from engines.pool import EnginePool
from gateway import thinking
from gateway.chains import Chains, ChainSet
from gateway.ratelimit import RateLimiter
from gateway.speech import check_speech
from observability.audit.log import AuditLog
from observability.audit.record import InputDigests, RequestSnapshot
from core.digest import OutputDigest
from observability.metrics import Metrics
from policies.base import Accept, Halt, Reject, Retry, StreamCheck, StreamFilter, StreamingPostPolicy, Verdict
from policies.registry import LoadedPolicy, PolicyChain

if TYPE_CHECKING:
    from gateway.admission import AdmissionGate

log = structlog.get_logger("omnigate.request")


@dataclass(slots=True)
class Attempt:
    """One engine call that produced a first chunk (the commit point)."""

    engine: Engine
    request: ChatCompletionRequest
    upstream: AsyncIterator[Delta]
    first: Delta
    #: perf_counter() when the engine request was sent (0: not one engine call, e.g. joined segments)
    sent: float = 0.0


@dataclass(slots=True)
class CompletionResult:
    request: ChatCompletionRequest
    completion: Completion
    ctx: RequestContext


@dataclass(slots=True)
class ResponseStream:
    """A committed stream. Iterate :meth:`deltas` once, then always :meth:`aclose`.

    :meth:`Pipeline.stream` primes it: it has already run up to the first
    released delta (held in ``_head``), so ``request`` is the attempt being
    served and ``ctx.response_headers`` holds what the verdicts added.
    """

    pipeline: "Pipeline"
    request: ChatCompletionRequest
    ctx: RequestContext
    attempt: Attempt
    _released: bool = False
    _gen: AsyncIterator[Delta] | None = None
    _head: Delta | None = None
    _ended: bool = False
    _iterated: bool = False

    async def _prime(self) -> None:
        """Run until the first released delta or the end; errors before that reach the caller."""
        self._gen = self.pipeline._run_stream(self)
        try:
            self._head = await anext(self._gen)
        except StopAsyncIteration:
            self._ended = True
        except BaseException:
            await self._gen.aclose()  # type: ignore[attr-defined]
            raise

    def deltas(self) -> AsyncIterator[Delta]:
        if self._iterated or self._gen is None:
            raise RuntimeError("a response stream is primed, then iterated once")
        self._iterated = True
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        assert self._gen is not None
        if self._head is not None:
            head, self._head = self._head, None
            yield head
        if not self._ended:
            async for d in self._gen:
                yield d

    async def aclose(self) -> None:
        """Release the upstream; safe to call whether or not iteration started or ended."""
        if self._gen is None:
            self._gen = _closed()
            await self.attempt.upstream.aclose()
            self.pipeline._finish(self.ctx, GeneratorExit())
        else:
            await self._gen.aclose()  # type: ignore[attr-defined]


def _text_only(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request without its media parts (what a ``digests`` or ``redacted`` record reads of it)."""
    messages = [
        m.model_copy(update={"content": [p for p in m.content if p.type == "text"]})
        if isinstance(m.content, list) else m
        for m in request.messages
    ]
    return request.model_copy(update={"messages": messages})


def _join(parts: list[Completion], separator: str) -> Completion:
    """Completions of consecutive segments as one answer."""
    out = Completion(finish_reason=parts[-1].finish_reason, sample_rate=parts[0].sample_rate,
                     channels=parts[0].channels)
    out.text = separator.join(p.text for p in parts if p.text)
    out.transcript = separator.join(p.transcript for p in parts if p.transcript)
    out.audio = b"".join(p.audio for p in parts)
    out.usage = Usage(sum(p.usage.prompt_tokens for p in parts), sum(p.usage.completion_tokens for p in parts))
    return out


async def _closed() -> AsyncIterator[Delta]:
    return
    yield  # pragma: no cover


_DEAD: Any = object()  # a shadow check that halted: not fed any more


@dataclass(slots=True)
class _Candidate:
    """A complete attempt that a post-policy wanted retried: served if it scores best when retries run out."""

    verdict: Retry
    request: ChatCompletionRequest
    completion: Completion
    release: Callable[[], list[Delta]]


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
        admission: "AdmissionGate | None" = None,
        sampling_defaults: dict[str, dict[str, Any]] | None = None,
        energy: "EnergyBook | None" = None,
    ) -> None:
        self.pool = pool
        #: the chain generation new requests take (gateway/chains.py); a bare chain: one generation of it
        self.policies = policies if isinstance(policies, Chains) else Chains(ChainSet(policies))
        self.metrics = metrics
        self.audit = audit
        self.limiter = limiter
        #: the accuracy sentinel (``offer(engine, variant, completion)``), or None
        self.sentinel = sentinel
        #: the admission gate (gateway/admission.py); None: traffic control is off
        self.admission = admission
        #: per public model, the sampling parameters a request that sets none of its own is served with
        self.sampling_defaults: dict[str, dict[str, Any]] = sampling_defaults or {}
        #: the engines' joules per token (engines/energy.py), for usage.energy_joules; None: not estimated
        self.energy = energy
        self._background: set[asyncio.Task[None]] = set()

    @property
    def chain(self) -> PolicyChain:
        """The current default chain (what new requests without a policy set run)."""
        return self.policies.current.chain

    @property
    def chains(self) -> dict[str, PolicyChain]:
        """The current tenant policy sets by name; a tenant without one gets ``chain``."""
        return self.policies.current.sets

    def _chain(self, ctx: RequestContext) -> PolicyChain:
        # The generation the request began on, to its end: a reload meanwhile does not move it. The context
        # holds it as a lease (core knows no chains); the pipeline put it there, so it is a ChainSet.
        generation = ctx.policies if isinstance(ctx.policies, ChainSet) else self.policies.current
        return generation.for_set(ctx.policy_set)

    # -- the two entry points ----------------------------------------------
    async def stream(self, request: ChatCompletionRequest, ctx: RequestContext) -> ResponseStream:
        """Run everything up to the first upstream chunk; raise before committing."""
        self._begin(ctx, request)
        try:
            prepared = self._prepare(request, ctx)
            del request  # the media steps replace its parts: nothing here may keep the client's strings alive
            request = await prepared
            attempt = await self._open(request, ctx)
        except BaseException as exc:
            await self._settle(ctx, exc)
            raise
        rs = ResponseStream(self, attempt.request, ctx, attempt)
        await rs._prime()  # the stream's own teardown accounts for errors from here on
        return rs

    async def complete(self, request: ChatCompletionRequest, ctx: RequestContext) -> CompletionResult:
        self._begin(ctx, request)
        try:
            prepared = self._prepare(request, ctx)
            del request  # as in stream
            request = await prepared
            result = await self._complete(request, ctx)
        except BaseException as exc:
            await self._settle(ctx, exc)
            raise
        ctx.completion = result.completion
        await self._settle(ctx, None)
        return result

    async def admit(self, ctx: RequestContext) -> None:
        """Take the request's admission slot, once; the transport calls it before reading the body, so a
        request admission refuses costs neither its body nor any media work. Held until _finish."""
        if self.admission is not None and ctx.admission is None:
            ctx.admission = await self.admission.admit(ctx)

    async def refused(self, ctx: RequestContext, error: OmnigateError) -> None:
        """A request the transport refused before the pipeline (its key, its body): counted and audited."""
        self.metrics.in_flight.inc()
        await self._settle(ctx, error)

    # -- stages --------------------------------------------------------------
    def _begin(self, ctx: RequestContext, request: ChatCompletionRequest) -> None:
        ctx.public_model = request.model if self.pool.serves(request.model) else None
        ctx.stream = request.stream
        ctx.received = request
        ctx.policies = self.policies.current.acquire()  # let go in _finish
        self.metrics.in_flight.inc()

    async def _prepare(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        if self.audit is not None:
            self.audit.admit()
        tenant = ctx.tenant_config
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
        defaults = self.sampling_defaults.get(request.model)
        if defaults:
            # Each default fills only a parameter the client left unset; what was filled is audited.
            applied = {k: v for k, v in defaults.items() if getattr(request, k) is None}
            if applied:
                request = request.model_copy(update=applied)
                ctx.sampling_defaults = applied
        chain = self._chain(ctx)
        if request.choices > 1 and (chain.post or chain.stream):
            # Post-policies and stream filters judge and retry one answer; n answers would pass unjudged.
            raise InvalidRequest("n > 1 is not available for this model: its answers are checked one at a time",
                                 param="n")
        digests: asyncio.Future[Any] | None = None
        media_seen = False
        for policy in chain.pre:
            if type(policy.impl).media_only:
                if not request.input_modalities() - {"text"}:
                    continue  # a media step has nothing to do on a text-only request: not run, not recorded
                if not media_seen:
                    media_seen, digests = True, self._let_go_of_media(ctx)
            request = await self._run_pre(policy, request, ctx)
        if digests is not None:
            await digests  # made, so the client's strings are gone before the engine is called
        return request

    def _let_go_of_media(self, ctx: RequestContext) -> "asyncio.Future[Any] | None":
        """Keep for the audit record only the digests of the client's parts, so that its media strings
        go as soon as the media steps have replaced them (a request otherwise holds its input until it
        ends: what its peak memory would be made of). Hashed on a thread while the media steps run.
        ``audit_content: raw`` keeps the request as sent, media included: that is what it records."""
        received = ctx.received
        if received is None or ctx.input_digests is not None or ctx.audit_content == "raw":
            return None
        ctx.received = _text_only(received)
        if self.audit is None:
            return None
        digests = ctx.input_digests = InputDigests(received)
        return asyncio.get_running_loop().run_in_executor(None, digests.get)

    async def _run_pre(
        self, policy: LoadedPolicy, request: ChatCompletionRequest, ctx: RequestContext
    ) -> ChatCompletionRequest:
        t0 = time.perf_counter()
        verdict, detail = "accept", None
        if policy.shadow:
            degraded, control = len(ctx.degraded), set(ctx.control_state)
        try:
            out = await policy.impl.pre(request, ctx)
            if out is not request:
                verdict = "rewrite"
        except OmnigateError as exc:
            verdict, detail = "reject", exc.code
            if not policy.shadow:
                raise
            out = request
        finally:
            self._record(policy, ctx, verdict, time.perf_counter() - t0, detail)
        if policy.shadow:
            # A shadow policy's rewrite is not served, so it is neither announced nor audited as done.
            del ctx.degraded[degraded:]
            for key in set(ctx.control_state) - control:
                del ctx.control_state[key]
            return request
        return out

    def _record(
        self,
        policy: LoadedPolicy,
        ctx: RequestContext,
        verdict: str,
        seconds: float,
        detail: str | None,
        score: float | None = None,
    ) -> None:
        from core.context import PolicyRun

        ctx.policy_runs.append(
            PolicyRun(
                policy.name, policy.stage, verdict, seconds * 1000, policy.shadow, detail, ctx.retries + 1, score
            )
        )
        self.metrics.policy_decisions.labels(policy.name, policy.stage, verdict, str(policy.shadow).lower()).inc()
        self.metrics.policy_duration.labels(policy.name, policy.stage).observe(seconds)

    def _adapt(self, engine: Engine, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest | None:
        """Fit the request to what the engine can do; None when it cannot serve it at all."""
        missing = request.input_modalities() - engine.capabilities.input_modalities
        if missing:
            return None
        request, held = thinking.fit(engine, request)
        if held is not None:
            ctx.degrade(held)
        if request.wants_audio and not engine.capabilities.speaks:
            ctx.degrade("engine-text-only")
            return request.model_copy(update={"modalities": ["text"], "audio": None})
        return request

    def _engines_for(self, request: ChatCompletionRequest) -> list[Engine]:
        engines = self.pool.candidates(request.model)
        if not engines:
            raise self._no_engine(request)  # every engine of the model serves other weights than configured
        fitting = [e for e in engines if not (request.input_modalities() - e.capabilities.input_modalities)]
        if not fitting:
            kinds = ", ".join(sorted(request.input_modalities() - {"text"}))
            raise InvalidRequest(f"the model {request.model!r} does not accept {kinds} input", param="messages")
        features = request.features()
        if features:
            # A field an engine cannot honour is refused, never dropped on the way to it.
            able = [e for e in fitting if features <= e.capabilities.features]
            if not able:
                field = min(features - set().union(*(e.capabilities.features for e in fitting)) or features)
                raise InvalidRequest(f"the model {request.model!r} does not support {field}", param=field)
            fitting = able
        if thinking.needs_enforcement(request):
            fitting = [e for e in fitting if e.capabilities.thinking_budget]
            if not fitting:
                raise thinking.refuse(request)
        return fitting

    def _engine_failed(self, engine: Engine, exc: EngineError, ctx: RequestContext, more: bool) -> None:
        self.metrics.engine_errors.labels(engine.name, exc.kind).inc()
        if exc.retryable:
            self.pool.report_failure(engine)
        log.warning("engine_attempt_failed", engine=engine.name, kind=exc.kind, error=exc.detail,
                    failover=exc.retryable and more)
        if exc.retryable and more:
            self.metrics.failovers.labels(engine.name).inc()

    async def _open(self, request: ChatCompletionRequest, ctx: RequestContext) -> Attempt:
        """Call engines in order until one yields its first chunk.

        Each try first claims a slot on the first engine left that has one (waiting boundedly
        when all are at their cap, see engines/pool.py); a failed engine is dropped from the list.
        """
        engines = self._engines_for(request)
        last: EngineError | None = None
        try:
            while engines:
                engine = await self.pool.claim(engines, request.model)
                if engine is None:
                    break
                engines = [e for e in engines if e is not engine]
                adapted = self._adapt(engine, request, ctx)
                if adapted is None:
                    self.pool.release(engine, settled=False)
                    continue
                ctx.attempts += 1
                upstream = engine.stream(adapted)
                sent = time.perf_counter()
                try:
                    first = await anext(upstream)
                except StopAsyncIteration:
                    last = EngineProtocolError(f"engine {engine.name} sent an empty stream", engine=engine.name)
                except EngineError as exc:
                    last = exc
                except BaseException:
                    self.pool.release(engine, settled=False)
                    raise
                else:
                    ctx.engine, ctx.variant = engine.name, engine.config.variant
                    # The engine's own time to first token: no body read, pre-policy, slot wait or hold-back in it.
                    ctx.upstream_ttft_s, ctx.upstream_e2e_s = time.perf_counter() - sent, None
                    return Attempt(engine, adapted, upstream, first, sent)
                await upstream.aclose()
                self._engine_failed(engine, last, ctx, more=bool(engines))
                self.pool.release(engine, settled=last.retryable)
                if not last.retryable:
                    raise last
            raise last or self._no_engine(request)
        finally:
            # An engine error's traceback holds this frame, whose ``last`` holds the error: a cycle that
            # would keep the request (its media) alive until the next full collection.
            last = None

    def _no_engine(self, request: ChatCompletionRequest) -> EngineError:
        # Engines at their cap are waited for (or refused with engine_busy) by pool.claim; here none
        # could be claimed at all (e.g. half-open with its trials taken, the others unavailable).
        return EngineUnavailable(f"no engine can serve {request.model!r} now")

    def _unbind(self, ctx: RequestContext) -> None:
        """Give back the engine slot of an attempt being replaced (post-policy retry, next segment)."""
        if ctx.engine is not None:
            self.pool.release(ctx.engine, settled=False)
            ctx.engine = None

    async def _complete(self, request: ChatCompletionRequest, ctx: RequestContext) -> CompletionResult:
        budget = self._chain(ctx).max_retries
        candidates: list[_Candidate] = []
        while True:
            ctx.retries_left = budget
            completion, served = await self._complete_segments(request, ctx)
            verdict, accepted = await self._post(served, completion, ctx)
            if isinstance(verdict, Accept):
                self._apply(accepted, ctx, committed=False)
                return CompletionResult(served, completion, ctx)
            if isinstance(verdict, Reject):
                raise verdict.error
            candidates.append(_Candidate(verdict, served, completion, lambda: []))
            if budget > 0:
                budget -= 1
                request = self._retry(request, verdict, ctx)
                self._unbind(ctx)
                continue
            best = self._exhausted(candidates, ctx)
            self._account(ctx, best.completion)
            return CompletionResult(best.request, best.completion, ctx)

    def _exhausted(self, candidates: list[_Candidate], ctx: RequestContext) -> _Candidate:
        """No retry left: serve the best-scoring attempt as its verdict says, or raise its refusal."""
        ctx.degrade("retries-exhausted")
        best = max(
            enumerate(candidates),
            key=lambda ic: (ic[1].verdict.score if ic[1].verdict.score is not None else float("-inf"), ic[0]),
        )[1]
        outcome = best.verdict.exhausted
        policy = next((p for p in self._chain(ctx).post if p.name == best.verdict.reason), None)
        if policy is not None:
            kind = "exhausted_reject" if isinstance(outcome, Reject) else "exhausted_serve"
            self._record(policy, ctx, kind, 0.0, None, best.verdict.score)
        if isinstance(outcome, Reject):
            raise outcome.error
        if isinstance(outcome, Accept):
            self._apply([outcome], ctx, committed=False)
        return best

    def _apply(self, accepted: list[Accept], ctx: RequestContext, committed: bool) -> None:
        """Headers and notes of the verdicts acted on; headers only while the response has not started."""
        for v in accepted:
            if v.headers and not committed:
                ctx.response_headers.update(v.headers)
            if v.notes:
                ctx.notes.update(v.notes)

    async def _complete_once(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> tuple[Completion, ChatCompletionRequest]:
        engines = self._engines_for(request)
        last: EngineError | None = None
        try:
            while engines:
                engine = await self.pool.claim(engines, request.model)
                if engine is None:
                    break
                engines = [e for e in engines if e is not engine]
                adapted = self._adapt(engine, request, ctx)
                if adapted is None:
                    self.pool.release(engine, settled=False)
                    continue
                ctx.attempts += 1
                sent = time.perf_counter()
                try:
                    completion = await engine.complete(adapted)
                except EngineError as exc:
                    last = exc
                    self._engine_failed(engine, exc, ctx, more=bool(engines))
                    self.pool.release(engine, settled=exc.retryable)
                    if not exc.retryable:
                        raise
                    continue
                except BaseException:
                    self.pool.release(engine, settled=False)
                    raise
                ctx.engine, ctx.variant = engine.name, engine.config.variant
                ctx.ttft_s = ctx.elapsed()
                # A whole answer has no first token to time: its engine latency is a signal of its own.
                ctx.upstream_ttft_s, ctx.upstream_e2e_s = None, time.perf_counter() - sent
                self._account(ctx, completion)
                return completion, adapted
            raise last or self._no_engine(request)
        finally:
            last = None  # as in _open: no cycle through this frame

    async def _complete_segments(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> tuple[Completion, ChatCompletionRequest]:
        completion, served = await self._complete_once(request, ctx)
        seg = ctx.segmentation
        if seg is None or len(seg.boundaries) < 2:
            return completion, served
        parts = [completion]
        for i in range(1, len(seg.boundaries)):
            self.metrics.segments.inc()
            self._unbind(ctx)  # the previous segment's engine slot: one slot per request at a time
            more, _ = await self._complete_once(seg.build(served, i), ctx)
            parts.append(more)
        joined = _join(parts, seg.separator)
        self._account(ctx, joined)
        return joined, served

    def _retry(self, request: ChatCompletionRequest, verdict: Retry, ctx: RequestContext) -> ChatCompletionRequest:
        ctx.retries += 1
        self.metrics.retries.labels(verdict.reason).inc()
        log.info("request_retry", reason=verdict.reason, attempt=ctx.retries, engine=ctx.engine,
                 score=verdict.score, adjusted=sorted(verdict.update) or None)
        return request.model_copy(update=verdict.update) if verdict.update else request

    async def _post(
        self, request: ChatCompletionRequest, completion: Completion, ctx: RequestContext
    ) -> tuple[Verdict, list[Accept]]:
        """Post-policies in order; the first acting non-Accept verdict wins. Also returns the Accepts seen."""
        accepted: list[Accept] = []
        for policy in self._chain(ctx).post:
            t0 = time.perf_counter()
            verdict = await policy.impl.post(request, completion, ctx)
            out = self._judged(policy, ctx, verdict, t0, accepted)
            if out is not None:
                return out, accepted
        return Accept(), accepted

    def _judged(
        self, policy: LoadedPolicy, ctx: RequestContext, verdict: Verdict, t0: float, accepted: list[Accept]
    ) -> Verdict | None:
        """Record one post verdict; the verdict to act on, or None to go on with the next policy."""
        name = type(verdict).__name__.lower()
        self._record(policy, ctx, name, time.perf_counter() - t0, getattr(verdict, "reason", None) or getattr(
            verdict, "detail", None), getattr(verdict, "score", None))
        if policy.shadow:
            return None
        if isinstance(verdict, Accept):
            accepted.append(verdict)
            return None
        if isinstance(verdict, Retry):
            return replace(verdict, reason=policy.name)
        return verdict

    # -- the committed stream ------------------------------------------------
    async def _run_stream(self, rs: ResponseStream) -> AsyncIterator[Delta]:
        """Relay one stream through filters and checks; retry only while nothing was released."""
        ctx, attempt = rs.ctx, rs.attempt
        chain = self._chain(ctx)
        budget = chain.max_retries
        candidates: list[_Candidate] = []
        error: BaseException | None = None
        released = ctx.output = OutputDigest(ctx.audit_content != "digests") if self.audit is not None else None
        try:
            while True:
                ctx.retries_left = budget
                rs.attempt, rs.request = attempt, attempt.request
                filters = [(p, p.impl.open_stream(attempt.request, ctx)) for p in chain.stream]
                checks = self._open_checks(attempt.request, ctx)
                completion = Completion()
                relayed = attempt
                if ctx.segmentation is not None and len(ctx.segmentation.boundaries) > 1:
                    joined = self._concat(attempt, ctx)
                    relayed = Attempt(attempt.engine, attempt.request, joined, await anext(joined))
                halted: Halt | None = None
                try:
                    async for delta in self._relay(relayed, filters, checks, completion, ctx):
                        rs._released = True
                        if released is not None:
                            released.add(delta)
                        yield delta
                except Halt as h:
                    halted = h
                accepted: list[Accept] = []
                if halted is not None:
                    verdict: Verdict = halted.verdict
                    release: Callable[[], list[Delta]] = list
                elif checks:
                    verdict, release, accepted = await self._end_checks(
                        attempt.request, completion, ctx, filters, checks
                    )
                else:
                    verdict, accepted = await self._post(attempt.request, completion, ctx)
                    release = lambda filters=filters: self._flush(filters)  # noqa: E731
                if isinstance(verdict, Reject):
                    raise verdict.error
                if isinstance(verdict, Accept):
                    self._apply(accepted, ctx, committed=rs._released)
                    for out in release():
                        rs._released = True
                        yield self._mark(ctx, out)
                    self._account(ctx, completion)
                    return
                # Retry. Only a whole attempt can be served later; a halted one was cut short.
                if halted is None and not rs._released:
                    candidates.append(_Candidate(verdict, attempt.request, completion, release))
                if budget > 0 and not rs._released:
                    budget -= 1
                    request = self._retry(attempt.request, verdict, ctx)
                    self._unbind(ctx)
                    attempt = await self._open(request, ctx)
                    continue
                if rs._released:
                    # Too late to hold anything back: terminate if the policy says so, else finish flagged.
                    if isinstance(verdict.exhausted, Reject):
                        raise verdict.exhausted.error
                    ctx.degrade("retries-exhausted")
                    if isinstance(verdict.exhausted, Accept):
                        self._apply([verdict.exhausted], ctx, committed=True)
                    for out in release():
                        yield self._mark(ctx, out)
                    self._account(ctx, completion)
                    return
                if not candidates:
                    if isinstance(verdict.exhausted, Reject):
                        raise verdict.exhausted.error
                    raise AnswerWithheld(f"policy {verdict.reason} held the answer back and no retry is left")
                best = self._exhausted(candidates, ctx)
                rs.request = best.request
                for out in best.release():
                    rs._released = True
                    yield self._mark(ctx, out)
                self._account(ctx, best.completion)
                return
        except BaseException as exc:
            error = exc
            raise
        finally:
            # Finished (and the record handed to the audit) before any await a cancelled task may not complete.
            fut = self._finish(ctx, error)
            error = None  # its traceback holds this frame: no cycle through it
            try:
                await attempt.upstream.aclose()
            finally:
                # The audit record is committed before the stream's last frame and [DONE] go out.
                await self._durable(ctx, fut)

    @staticmethod
    def _mark(ctx: RequestContext, d: Delta) -> Delta:
        """A delta released at the end of an attempt (held back until then): first text/audio, audit digest."""
        if ctx.output is not None:
            ctx.output.add(d)
        if ctx.ttft_s is None and (d.text or d.audio):
            ctx.ttft_s = ctx.elapsed()
        if ctx.first_audio_s is None and d.audio:
            ctx.first_audio_s = ctx.elapsed()
        return d

    def _open_checks(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> list[tuple[LoadedPolicy, Any]]:
        """One entry per post-policy, in order: its stream check, or None for a plain post-policy."""
        out: list[tuple[LoadedPolicy, Any]] = []
        for p in self._chain(ctx).post:
            impl = p.impl
            out.append((p, impl.open_check(request, ctx) if isinstance(impl, StreamingPostPolicy) else None))
        return out if any(c is not None for _, c in out) else []

    async def _feed_checks(
        self, checks: list[tuple[LoadedPolicy, Any]], batch: list[Delta], ctx: RequestContext
    ) -> list[Delta]:
        for i, (policy, check) in enumerate(checks):
            if check is None or check is _DEAD or not batch:
                continue
            released: list[Delta] = []
            for d in batch:
                t0 = time.perf_counter()
                try:
                    out = await check.feed(d)
                except Halt as h:
                    v = h.verdict
                    self._record(policy, ctx, type(v).__name__.lower(), time.perf_counter() - t0, "halted",
                                 getattr(v, "score", None))
                    if not policy.shadow:
                        if isinstance(v, Retry):
                            h.verdict = replace(v, reason=policy.name)
                        raise
                    checks[i] = (policy, _DEAD)
                    released = batch
                    break
                released.extend([d] if policy.shadow else out)
            batch = released
        return batch

    async def _end_checks(
        self,
        request: ChatCompletionRequest,
        completion: Completion,
        ctx: RequestContext,
        filters: list[tuple[LoadedPolicy, StreamFilter]],
        checks: list[tuple[LoadedPolicy, Any]],
    ) -> tuple[Verdict, Callable[[], list[Delta]], list[Accept]]:
        """End of an attempt: the filters' tails go through the checks, then each post verdict in order.

        A check's held deltas move on to the next check only after it accepted,
        so every check judges all that would reach the client.
        """
        batch = self._flush(filters)
        accepted: list[Accept] = []
        for policy, check in checks:
            if check is _DEAD:
                continue
            t0 = time.perf_counter()
            if check is None:
                verdict: Verdict = await policy.impl.post(request, completion, ctx)
                out = batch
            else:
                out = []
                try:
                    for d in batch:
                        out.extend(await check.feed(d))
                except Halt as h:
                    verdict = h.verdict
                else:
                    verdict = await check.finish()
            acting = self._judged(policy, ctx, verdict, t0, accepted)
            if acting is None:
                if check is not None:
                    batch = batch if policy.shadow else out + check.release()
                continue
            held: StreamCheck | None = check

            def release(out: list[Delta] = out, held: StreamCheck | None = held) -> list[Delta]:
                return out + (held.release() if held is not None else [])

            return acting, release, accepted
        return Accept(), (lambda batch=batch: batch), accepted

    async def _relay(
        self,
        attempt: Attempt,
        filters: list[tuple[LoadedPolicy, StreamFilter]],
        checks: list[tuple[LoadedPolicy, Any]],
        completion: Completion,
        ctx: RequestContext,
    ) -> AsyncIterator[Delta]:
        engine = attempt.engine
        gap = self.metrics.chunk_gap.labels(engine.name, engine.config.variant)
        upstream = attempt.upstream
        first: Delta | None = attempt.first
        last_t = 0.0
        cap = attempt.request.output_token_limit
        if cap is not None:
            cap *= attempt.request.choices  # n > 1: the pieces of every choice arrive on one stream
        pieces = 0
        try:
            while True:
                if first is not None:
                    delta, first = first, None
                else:
                    try:
                        delta = await anext(upstream)
                    except StopAsyncIteration:
                        if attempt.sent:
                            ctx.upstream_e2e_s = time.perf_counter() - attempt.sent
                        break
                cut = False
                if cap is not None and (n := delta.output_pieces):
                    # The engine ignored max_tokens: each streamed piece (text, reasoning, a tool call's
                    # arguments) carries at least one token, so more pieces than the cap means more tokens
                    # than the cap. Cut it there.
                    pieces += n
                    if pieces > cap:
                        ctx.degrade("output-capped")
                        delta = Delta(finish_reason="length")
                        completion.usage = Usage(completion.usage.prompt_tokens, cap)
                        cut = True
                completion.add(delta)
                out = [delta] if not filters else self._feed(filters, delta)
                if checks:
                    out = await self._feed_checks(checks, out, ctx)
                for d in out:
                    now = time.perf_counter()
                    if last_t:
                        gap.observe(now - last_t)
                    last_t = now
                    if ctx.ttft_s is None and (d.text or d.audio):
                        ctx.ttft_s = now - ctx.started
                    if ctx.first_audio_s is None and d.audio:
                        ctx.first_audio_s = now - ctx.started
                    yield d
                if cut:
                    break
        except EngineError as exc:
            self.metrics.engine_errors.labels(engine.name, exc.kind).inc()
            self.pool.report_failure(engine)
            log.warning("engine_stream_failed", engine=engine.name, kind=exc.kind, error=exc.detail)
            raise
        finally:
            await upstream.aclose()

    async def _concat(self, attempt: Attempt, ctx: RequestContext) -> AsyncIterator[Delta]:
        """One engine call per segment, in order, as one stream (see the module docstring)."""
        seg = ctx.segmentation
        assert seg is not None
        n = len(seg.boundaries)
        total = Usage()
        current = attempt
        try:
            for i in range(n):
                last = i == n - 1
                if i:
                    self.metrics.segments.inc()
                    self._unbind(ctx)  # the previous segment's engine slot: one slot per request at a time
                    current = await self._open(seg.build(attempt.request, i), ctx)
                    if seg.separator:
                        yield Delta(text=seg.separator)
                sent_usage = False
                delta: Delta | None = current.first
                while delta is not None:
                    if delta.usage is not None:
                        total = Usage(total.prompt_tokens + delta.usage.prompt_tokens,
                                      total.completion_tokens + delta.usage.completion_tokens)
                    if not last:
                        delta = dataclasses.replace(delta, finish_reason=None, usage=None, audio_done=False)
                    elif delta.usage is not None:
                        delta, sent_usage = dataclasses.replace(delta, usage=total), True
                    if delta.text or delta.audio or delta.transcript or delta.finish_reason or delta.usage \
                            or delta.audio_done or delta.tool_calls or delta.reasoning:
                        yield delta
                    try:
                        delta = await anext(current.upstream)
                    except StopAsyncIteration:
                        delta = None
                if last and not sent_usage and (total.prompt_tokens or total.completion_tokens):
                    yield Delta(usage=total)
                if not last:
                    await current.upstream.aclose()
        finally:
            await current.upstream.aclose()

    def _feed(self, filters: list[tuple[LoadedPolicy, StreamFilter]], delta: Delta) -> list[Delta]:
        batch = [delta]
        for policy, f in filters:
            released: list[Delta] = []
            for d in batch:
                out = f.feed(d)
                released.extend([d] if policy.shadow else out)
            batch = released
        return batch

    def _flush(self, filters: list[tuple[LoadedPolicy, StreamFilter]]) -> list[Delta]:
        """End of stream: each filter's held tail, passed through the filters after it."""
        batch: list[Delta] = []
        for policy, f in filters:
            if policy.shadow:
                f.finish()
                continue
            out: list[Delta] = []
            for d in batch:
                out.extend(f.feed(d))
            out.extend(f.finish())
            batch = out
        return batch

    # -- accounting ----------------------------------------------------------
    def _account(self, ctx: RequestContext, completion: Completion) -> None:
        ctx.prompt_tokens = completion.usage.prompt_tokens
        ctx.completion_tokens = completion.usage.completion_tokens
        if completion.audio and completion.sample_rate:
            ctx.audio_seconds = len(completion.audio) / (2 * completion.channels * completion.sample_rate)
        if completion.audio and self.sentinel is not None and ctx.engine is not None:
            self.sentinel.offer(ctx.engine, ctx.variant, completion, model=ctx.public_model, tenant=ctx.tenant)
        if self.energy is not None:
            ctx.energy_joules = self.energy.estimate(ctx.engine, ctx.completion_tokens, ctx.audio_seconds)

    async def _settle(self, ctx: RequestContext, error: BaseException | None) -> None:
        await self._durable(ctx, self._finish(ctx, error))

    async def _durable(self, ctx: RequestContext, fut: "asyncio.Future[int] | None") -> None:
        """Unless the client left, wait (at most ``audit.ack_timeout_s``) until the audit record is committed."""
        if fut is not None and self.audit is not None and ctx.outcome != "cancelled":
            await self.audit.wait(fut)

    def _finish(self, ctx: RequestContext, error: BaseException | None) -> "asyncio.Future[int] | None":
        """Account for the request, release its slots and hand its record to the audit; once per request."""
        if ctx.outcome is not None:
            return None
        if self.admission is not None:
            self.admission.release(ctx)
        if ctx.media_budget is not None:
            ctx.media_budget.release()
        if ctx.policies is not None:
            ctx.policies.release()  # the last request of a reloaded-away generation closes it
        self.metrics.in_flight.dec()
        if ctx.engine is not None:
            # One report per request (never per chunk): latency and outcome for its window and circuit.
            if error is None:
                self.pool.report_success(ctx.engine, ctx.ttft_s, ctx.first_audio_s, ctx.elapsed(),
                                         ctx.upstream_ttft_s, ctx.upstream_e2e_s,
                                         ctx.completion_tokens, ctx.audio_seconds)
            self.pool.release(ctx.engine, settled=error is None or isinstance(error, EngineError))
        if error is None:
            ctx.outcome = "degraded" if ctx.degraded else "served"
        elif isinstance(error, OmnigateError):
            ctx.status = error.status
            ctx.error_code = error.code
            # Load refused on purpose (overload, engine busy, audit full) is a refusal, not a failure.
            refused = error.status < 500 or isinstance(error, Overloaded)
            ctx.outcome = "refused" if refused else "failed"
        elif isinstance(error, GeneratorExit) or type(error).__name__ == "CancelledError":
            ctx.outcome = "cancelled"
            self.metrics.client_disconnects.inc()
        else:
            ctx.outcome, ctx.status, ctx.error_code = "failed", 500, "internal_error"
        m = self.metrics
        m.requests.labels(ctx.public_model or "unknown", ctx.outcome).inc()
        for reason in ctx.degraded:
            m.degradations.labels(reason).inc()
        engine, variant = ctx.engine or "none", ctx.variant or "none"
        m.duration.labels(engine, variant, ctx.outcome).observe(ctx.elapsed())
        if ctx.ttft_s is not None and ctx.engine:
            m.ttft.labels(engine, variant).observe(ctx.ttft_s)
        if ctx.first_audio_s is not None and ctx.engine:
            m.first_audio.labels(engine, variant).observe(ctx.first_audio_s)
        if ctx.upstream_ttft_s is not None and ctx.engine:
            m.upstream_ttft.labels(engine, variant).observe(ctx.upstream_ttft_s)
        if ctx.upstream_e2e_s is not None and ctx.engine:
            m.upstream_duration.labels(engine, variant, str(ctx.stream).lower()).observe(ctx.upstream_e2e_s)
        if ctx.audio_seconds and ctx.engine:
            m.audio_output.labels(engine, variant).inc(ctx.audio_seconds)
        log.info(
            "request_finished",
            tenant=ctx.tenant,
            model=ctx.public_model,
            stream=ctx.stream,
            engine=ctx.engine,
            variant=ctx.variant,
            outcome=ctx.outcome,
            status=ctx.status,
            error_code=ctx.error_code,
            attempts=ctx.attempts,
            retries=ctx.retries,
            degraded=ctx.degraded or None,
            priority=ctx.load.priority if ctx.load is not None else None,
            admitted_at_in_flight=ctx.load.in_flight if ctx.load is not None else None,
            policies=[(p.name, p.verdict) for p in ctx.policy_runs] or None,
            attempt_log=[
                {"attempt": p.attempt, "policy": p.name, "verdict": p.verdict, "score": p.score}
                for p in ctx.policy_runs if p.stage == "post"
            ] or None,
            notes=ctx.notes or None,
            ttft_ms=round(ctx.ttft_s * 1000, 2) if ctx.ttft_s is not None else None,
            duration_ms=round(ctx.elapsed() * 1000, 2),
            prompt_tokens=ctx.prompt_tokens,
            completion_tokens=ctx.completion_tokens,
        )
        tenant = ctx.tenant_config
        if tenant is not None and tenant.tokens_per_minute and self.limiter is not None:
            used = ctx.prompt_tokens + ctx.completion_tokens
            if used:
                task = asyncio.get_running_loop().create_task(self.limiter.charge(tenant, used))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if self.audit is None:
            return None
        snapshot = RequestSnapshot(ctx, ctx.received, ctx.output, ctx.completion, ctx.elapsed() * 1000)
        return self.audit.submit("request", request_id=ctx.request_id, tenant=ctx.tenant, snapshot=snapshot)
