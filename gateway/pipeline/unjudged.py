"""A policy that could not judge: its receipt says why, and its ``on_error`` decides what happens.

A guard's model can be unavailable or fail, and a part can be beyond what it can look at. That is never
"clean": the policy's :class:`core.context.Scan` records what it missed and which ``on_error`` applied
(policies/settings.py ``PolicySpec``). ``fail_closed`` (the default) refuses the request with 503
``guard_unavailable``; ``fail_open`` serves it, unscreened by that policy, and says so in the receipt. A
shadow policy never refuses. A policy's other errors (``OmnigateError`` but ``GuardUnavailable``: a part
it refuses, a limit) are its verdicts, not failures to judge.
"""

from __future__ import annotations

from collections.abc import Awaitable

import structlog

from core.context import RequestContext
from core.errors import GuardUnavailable, OmnigateError
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from policies.base import Accept, Halt, Reject, StreamCheck, Verdict
from policies.registry import LoadedPolicy

log = structlog.get_logger("omnigate.request")

#: the verdict recorded for a policy that could not judge and let the request through
NOT_SCANNED = "not_scanned"
#: the verdict recorded for a policy that could not judge and refused the request (``fail_closed``)
UNAVAILABLE = "unavailable"


def could_not_judge(exc: BaseException) -> bool:
    """Whether ``exc`` from a policy means it could not judge (rather than a verdict it reached)."""
    return isinstance(exc, GuardUnavailable) or (
        isinstance(exc, Exception) and not isinstance(exc, (OmnigateError, Halt))
    )


def unjudged(policy: LoadedPolicy, ctx: RequestContext, exc: Exception) -> GuardUnavailable | None:
    """Record that ``policy`` could not judge; the error to refuse the request with, or None when it
    goes on unscreened by it (``fail_open``, or a shadow policy)."""
    scan = ctx.outputs.scan(policy.name)
    why = (exc.code or "unavailable") if isinstance(exc, OmnigateError) else f"failed: {type(exc).__name__}"
    if not scan.missed:  # the policy may have said which parts it missed; else it missed the whole request
        scan.missed.append({"part": "*", "why": why})
    scan.on_error = policy.on_error
    if not isinstance(exc, OmnigateError):
        log.error("policy_failed", policy=policy.name, on_error=policy.on_error, exc_info=exc)
    if policy.on_error == "fail_open" or policy.shadow:
        return None
    refused = GuardUnavailable(
        f"the {policy.name} guard could not judge this request; it was not served unscreened", retry_after=1
    )
    refused.__cause__ = exc
    return refused


async def post_verdict(
    policy: LoadedPolicy, request: ChatCompletionRequest, completion: Completion, ctx: RequestContext
) -> Verdict:
    """A post-policy's verdict; one that could not judge is refused or let through as its ``on_error`` says."""
    judging: Awaitable[Verdict] = policy.impl.post(request, completion, ctx)
    try:
        return await judging
    except Exception as exc:
        if not could_not_judge(exc):
            raise
        refused = unjudged(policy, ctx, exc)
        return Accept(detail=NOT_SCANNED) if refused is None else Reject(refused)


async def check_verdict(
    policy: LoadedPolicy, check: StreamCheck, batch: list[Delta], ctx: RequestContext
) -> tuple[Verdict, list[Delta]]:
    """A streaming check's verdict at the end of an attempt, with the deltas of ``batch`` it cleared; one
    that could not judge is refused or let through as its ``on_error`` says."""
    out: list[Delta] = []
    try:
        for d in batch:
            out.extend(await check.feed(d))
        return await check.finish(), out
    except Halt as h:
        return h.verdict, out
    except Exception as exc:
        if not could_not_judge(exc):
            raise
        refused = unjudged(policy, ctx, exc)
        return (Accept(detail=NOT_SCANNED) if refused is None else Reject(refused)), out


def verdict_name(verdict: Verdict) -> str:
    """How a verdict is recorded: its kind, or ``not_scanned`` / ``unavailable`` for a policy that could
    not judge and let the request through / refused it."""
    if isinstance(verdict, Accept) and verdict.detail == NOT_SCANNED:
        return NOT_SCANNED
    if isinstance(verdict, Reject) and isinstance(verdict.error, GuardUnavailable):
        return UNAVAILABLE
    return type(verdict).__name__.lower()
