"""Acting on post-policy verdicts, for both loops (the stream's, gateway/pipeline/stream.py, and the whole
answer's, gateway/pipeline/complete.py): the retried request, the best attempt when retries run out, and the
headers and notes of the verdicts acted on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from core.context import RequestContext
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from gateway.pipeline.accounting import Accounting
from observability.metrics import Metrics
from policies.base import Accept, Reject, Retry
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
