"""Acting on post-policy verdicts, for both loops (the stream's, gateway/pipeline/stream.py, and the whole
answer's, gateway/pipeline/complete.py): :class:`Rounds` decides, once for both, what an attempt's verdict
leads to (serve it, retry, serve the best attempt when retries run out, or refuse); and the retried request,
the best attempt, and the headers and notes of the verdicts acted on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from core.context import RequestContext
from core.errors import AnswerWithheld
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from gateway.pipeline.accounting import Accounting
from observability.metrics import Metrics
from policies.base import Accept, Reject, Retry, Verdict
from policies.registry import PolicyChain

log = structlog.get_logger("omnigate.request")


@dataclass(slots=True)
class Candidate:
    """A complete attempt that a post-policy wanted retried: served if it scores best when retries run out."""

    verdict: Retry
    request: ChatCompletionRequest
    completion: Completion
    release: Callable[[], list[Delta]]


def apply(accepted: list[Accept], ctx: RequestContext, committed: bool) -> None:
    """Headers and notes of the verdicts acted on; headers only while the response has not started."""
    for v in accepted:
        if v.headers and not committed:
            ctx.outputs.response_headers.update(v.headers)
        if v.notes:
            ctx.outputs.notes.update(v.notes)


def retried(
    request: ChatCompletionRequest, verdict: Retry, ctx: RequestContext, metrics: Metrics
) -> ChatCompletionRequest:
    """The request the next attempt sends: as the retry verdict adjusted it."""
    ctx.record.retries += 1
    metrics.retries.labels(verdict.reason).inc()
    log.info(
        "request_retry",
        reason=verdict.reason,
        attempt=ctx.record.retries,
        engine=ctx.record.engine,
        score=verdict.score,
        adjusted=sorted(verdict.update) or None,
    )
    return request.model_copy(update=verdict.update) if verdict.update else request


def exhausted(
    candidates: list[Candidate], ctx: RequestContext, chain: PolicyChain, accounting: Accounting
) -> Candidate:
    """No retry left: serve the best-scoring attempt as its verdict says, or raise its refusal."""
    ctx.outputs.degrade("retries-exhausted")
    best = max(
        enumerate(candidates),
        key=lambda ic: (ic[1].verdict.score if ic[1].verdict.score is not None else float("-inf"), ic[0]),
    )[1]
    outcome = best.verdict.exhausted
    policy = next((p for p in chain.post if p.name == best.verdict.reason), None)
    if policy is not None:
        kind = "exhausted_reject" if isinstance(outcome, Reject) else "exhausted_serve"
        accounting.policy_ran(policy, ctx, kind, 0.0, None, best.verdict.score)
    if isinstance(outcome, Reject):
        raise outcome.error
    if isinstance(outcome, Accept):
        apply([outcome], ctx, committed=False)
    return best


@dataclass(slots=True, frozen=True)
class Step:
    """What an attempt's verdict leads to: ``again`` (the request to try next), or the attempt to serve
    (``request``, ``completion`` and what is still to ``release`` of it); ``best``: the best of the earlier
    attempts, chosen when the retries ran out (not yet accounted for)."""

    again: ChatCompletionRequest | None = None
    request: ChatCompletionRequest | None = None
    completion: Completion | None = None
    release: Callable[[], list[Delta]] = list
    best: bool = False


@dataclass(slots=True)
class Rounds:
    """One request's retry budget and the complete attempts a post-policy wanted retried: the verdict loop
    of both the stream and the whole answer, as one decision (:meth:`judge`). Per request, never shared."""

    chain: PolicyChain
    ctx: RequestContext
    metrics: Metrics
    accounting: Accounting
    budget: int = field(init=False)
    candidates: list[Candidate] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.budget = self.chain.max_retries

    def judge(
        self,
        verdict: Verdict,
        accepted: list[Accept],
        request: ChatCompletionRequest,
        completion: Completion,
        release: Callable[[], list[Delta]] = list,
        *,
        released: bool = False,
        whole: bool = True,
    ) -> Step:
        """The step after an attempt judged ``verdict``. ``released``: some of the answer already reached
        the client (too late to hold anything back or retry); ``whole``: the attempt ran to its end (a
        halted one was cut short and is never served later). Raises the refusal of a Reject."""
        ctx = self.ctx
        if isinstance(verdict, Reject):
            raise verdict.error
        if isinstance(verdict, Accept):
            apply(accepted, ctx, committed=released)
            return Step(request=request, completion=completion, release=release)
        if whole and not released:
            self.candidates.append(Candidate(verdict, request, completion, release))
        if self.budget > 0 and not released:
            self.budget -= 1
            return Step(again=retried(request, verdict, ctx, self.metrics))
        if released:
            # Too late to hold anything back: terminate if the policy says so, else finish flagged.
            if isinstance(verdict.exhausted, Reject):
                raise verdict.exhausted.error
            ctx.outputs.degrade("retries-exhausted")
            if isinstance(verdict.exhausted, Accept):
                apply([verdict.exhausted], ctx, committed=True)
            return Step(request=request, completion=completion, release=release)
        if not self.candidates:
            if isinstance(verdict.exhausted, Reject):
                raise verdict.exhausted.error
            raise AnswerWithheld(f"policy {verdict.reason} held the answer back and no retry is left")
        best = exhausted(self.candidates, ctx, self.chain, self.accounting)
        return Step(request=best.request, completion=best.completion, release=best.release, best=True)
