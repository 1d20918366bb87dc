"""Before the engine: running one pre-policy (its verdict recorded, a shadow policy's rewrite not served)
and letting go of the client's media strings once the media steps have replaced them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from core.context import RequestContext
from core.errors import OmnigateError
from core.schemas import ChatCompletionRequest
from gateway.pipeline.unjudged import NOT_SCANNED, UNAVAILABLE, could_not_judge, unjudged
from observability.audit.record import InputDigests
from policies.base import Segmented
from policies.registry import LoadedPolicy


class PolicyRan(Protocol):
    def __call__(
        self, policy: LoadedPolicy, ctx: RequestContext, verdict: str, seconds: float, detail: str | None
    ) -> None: ...


def text_only(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request without its media parts (what a ``digests`` or ``redacted`` record reads of it)."""
    messages = [
        m.model_copy(update={"content": [p for p in m.content if p.type == "text"]})
        if isinstance(m.content, list)
        else m
        for m in request.messages
    ]
    return request.model_copy(update={"messages": messages})


def let_go_of_media(ctx: RequestContext, audited: bool) -> asyncio.Future[Any] | None:
    """Keep for the audit record only the digests of the client's parts, so that its media strings
    go as soon as the media steps have replaced them (a request otherwise holds its input until it
    ends: what its peak memory would be made of). Hashed on a thread while the media steps run.
    ``audit_content: raw`` keeps the request as sent, media included: that is what it records."""
    received = ctx.record.received
    if received is None or ctx.record.input_digests is not None or ctx.identity.audit_content == "raw":
        return None
    ctx.record.received = text_only(received)
    if not audited:
        return None
    digests = ctx.record.input_digests = InputDigests(received)
    return asyncio.get_running_loop().run_in_executor(None, digests.get)


async def run_pre(
    policy: LoadedPolicy, request: ChatCompletionRequest, ctx: RequestContext, ran: PolicyRan
) -> ChatCompletionRequest | Segmented:
    """One pre-policy: its verdict recorded; a shadow policy's rewrite not served."""
    t0 = time.perf_counter()
    verdict, detail = "accept", None
    mark = ctx.outputs.mark()
    out: ChatCompletionRequest | Segmented
    try:
        out = await policy.impl.pre(request, ctx)
        if out is not request:
            verdict = "rewrite"
    except Exception as exc:
        if could_not_judge(exc):
            verdict, detail = UNAVAILABLE, None
            refused = unjudged(policy, ctx, exc)
            if refused is not None:
                raise refused from exc
            verdict = NOT_SCANNED
        else:
            verdict, detail = "reject", exc.code if isinstance(exc, OmnigateError) else None
            if not policy.shadow:
                raise
        out = request
    finally:
        ran(policy, ctx, verdict, time.perf_counter() - t0, detail)
    if policy.shadow:
        # A shadow policy's rewrite (and segment plan) is not served: neither announced nor audited as done.
        ctx.outputs.undo(mark)
        return request
    return out
