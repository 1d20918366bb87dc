"""Segmented input (a :class:`core.context.SegmentPlan` a pre-policy made for audio too long for one
call), served as one engine call per segment, in order, concatenated into one response.

The first segment's first chunk is the commit point; later segments may still fail over before their
own first chunk; only the last segment's ``finish_reason`` is released and usage is summed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from core.context import RequestContext, SegmentPlan
from core.events import Completion, Delta, Usage
from core.schemas import ChatCompletionRequest
from gateway.pipeline.attempt import Attempt


def segmented(plan: SegmentPlan | None) -> bool:
    """More than one segment: the request is served as several engine calls."""
    return plan is not None and len(plan.boundaries) > 1


def segment_request(request: ChatCompletionRequest, plan: SegmentPlan, i: int) -> ChatCompletionRequest:
    """The request for segment ``i``: ``request`` (which carries segment 0) with the plan's first part
    replaced by segment ``i``'s; the prompt and every other part go with every segment."""
    old, new = plan.first, plan.parts[i]
    messages = []
    for message in request.messages:
        if isinstance(message.content, list) and any(p == old for p in message.content):
            content = [new if p == old else p for p in message.content]
            message = message.model_copy(update={"content": content})
        messages.append(message)
    return request.model_copy(update={"messages": messages})


def join(parts: list[Completion], separator: str) -> Completion:
    """Completions of consecutive segments as one answer."""
    out = Completion(
        finish_reason=parts[-1].finish_reason, sample_rate=parts[0].sample_rate, channels=parts[0].channels
    )
    out.text = separator.join(p.text for p in parts if p.text)
    out.transcript = separator.join(p.transcript for p in parts if p.transcript)
    out.audio = b"".join(p.audio for p in parts)
    out.usage = Usage(
        sum(p.usage.prompt_tokens for p in parts), sum(p.usage.completion_tokens for p in parts)
    )
    return out


async def concat(
    attempt: Attempt,
    plan: SegmentPlan,
    ctx: RequestContext,
    open_attempt: Callable[[ChatCompletionRequest, RequestContext], Awaitable[Attempt]],
    unbind: Callable[[RequestContext], None],
    counted: Callable[[], Any],
) -> AsyncGenerator[Delta, None]:
    """The segments' streams as one. Before each segment after the first, ``counted()``, then ``unbind``
    gives back the previous segment's engine slot (one slot per request at a time) and ``open_attempt``
    calls the next one (failing over before its first chunk)."""
    n = len(plan.boundaries)
    total = Usage()
    current = attempt
    try:
        for i in range(n):
            last = i == n - 1
            if i:
                counted()
                unbind(ctx)
                current = await open_attempt(segment_request(attempt.request, plan, i), ctx)
                if plan.separator:
                    yield Delta(text=plan.separator)
            sent_usage = False
            delta: Delta | None = current.first
            while delta is not None:
                if delta.usage is not None:
                    total = Usage(
                        total.prompt_tokens + delta.usage.prompt_tokens,
                        total.completion_tokens + delta.usage.completion_tokens,
                    )
                if not last:
                    delta = dataclasses.replace(delta, finish_reason=None, usage=None, audio_done=False)
                elif delta.usage is not None:
                    delta, sent_usage = dataclasses.replace(delta, usage=total), True
                if (
                    delta.text
                    or delta.audio
                    or delta.transcript
                    or delta.finish_reason
                    or delta.usage
                    or delta.audio_done
                    or delta.tool_calls
                    or delta.reasoning
                ):
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
