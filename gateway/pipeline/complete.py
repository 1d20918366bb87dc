"""The whole answer's loop (a JSON response): one attempt per try, the segments of a long input joined, and
the post-policies' verdicts acted on, retrying while the budget lasts (gateway/pipeline/verdicts.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.context import RequestContext, SegmentPlan
from core.events import Completion
from core.schemas import ChatCompletionRequest
from gateway.pipeline import verdicts
from gateway.pipeline.segments import join, segment_request, segmented

if TYPE_CHECKING:
    from gateway.pipeline import Pipeline


@dataclass(slots=True)
class CompletionResult:
    request: ChatCompletionRequest
    completion: Completion
    ctx: RequestContext


async def _once(
    p: Pipeline, request: ChatCompletionRequest, ctx: RequestContext
) -> tuple[Completion, ChatCompletionRequest]:
    """One attempt: engines in order until one returns a whole answer."""
    answered = await p.attempts.call(request, ctx, lambda engine, adapted: engine.complete(adapted))
    cap = answered.request.output_token_limit
    if cap is not None and answered.result.usage.completion_tokens > cap * answered.request.choices:
        # The engine ignored max_tokens. A whole answer has no pieces to count and the gateway no
        # tokenizer of the engine's model: it cannot be cut exactly, so it is served and announced.
        ctx.outputs.degrade("output-over-cap")
    ctx.record.ttft_s = ctx.record.elapsed()
    # A whole answer has no first token to time: its engine latency is a signal of its own.
    ctx.record.upstream_ttft_s, ctx.record.upstream_e2e_s = None, time.perf_counter() - answered.sent
    p.accounting.account(ctx, answered.result)
    return answered.result, answered.request


async def _segments(
    p: Pipeline, request: ChatCompletionRequest, plan: SegmentPlan | None, ctx: RequestContext
) -> tuple[Completion, ChatCompletionRequest]:
    completion, served = await _once(p, request, ctx)
    if plan is None or not segmented(plan):
        return completion, served
    parts = [completion]
    for i in range(1, len(plan.boundaries)):
        p.metrics.segments.inc()
        p.attempts.unbind(ctx)  # the previous segment's engine slot: one slot per request at a time
        more, _ = await _once(p, segment_request(served, plan, i), ctx)
        parts.append(more)
    joined = join(parts, plan.separator)
    p.accounting.account(ctx, joined)
    return joined, served


async def run_complete(
    p: Pipeline, request: ChatCompletionRequest, plan: SegmentPlan | None, ctx: RequestContext
) -> CompletionResult:
    """The answer served: the first accepted attempt, or the best one when the retries run out."""
    chain = p.chain_for(ctx)
    rounds = verdicts.Rounds(chain, ctx, p.metrics, p.accounting)
    while True:
        ctx.retries_left = rounds.budget
        completion, served = await _segments(p, request, plan, ctx)
        verdict, accepted = await p.relay.post(chain.post, served, completion, ctx)
        step = rounds.judge(verdict, accepted, served, completion)
        if step.again is not None:
            request = step.again
            p.attempts.unbind(ctx)
            continue
        assert step.request is not None and step.completion is not None
        if step.best:
            p.accounting.account(ctx, step.completion)
        return CompletionResult(step.request, step.completion, ctx)
