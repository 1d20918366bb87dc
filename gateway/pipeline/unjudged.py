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
from core.events import Completion
from core.schemas import ChatCompletionRequest
from policies.base import Accept, Verdict
from policies.registry import LoadedPolicy

log = structlog.get_logger("omnigate.request")

#: the verdict recorded for a policy that could not judge and let the request through
NOT_SCANNED = "not_scanned"


def could_not_judge(exc: BaseException) -> bool:
    """Whether ``exc`` from a policy means it could not judge (rather than a verdict it reached)."""
    return isinstance(exc, GuardUnavailable) or (
        isinstance(exc, Exception) and not isinstance(exc, OmnigateError)
    )


def unjudged(policy: LoadedPolicy, ctx: RequestContext, exc: Exception) -> None:
    """Record that ``policy`` could not judge; raise ``GuardUnavailable`` unless the request goes on."""
    scan = ctx.outputs.scan(policy.name)
    why = (exc.code or "unavailable") if isinstance(exc, OmnigateError) else f"failed: {type(exc).__name__}"
    if not scan.missed:  # the policy may have said which parts it missed; else it missed the whole request
        scan.missed.append({"part": "*", "why": why})
    scan.on_error = policy.on_error
    if not isinstance(exc, OmnigateError):
        log.error("policy_failed", policy=policy.name, on_error=policy.on_error, exc_info=exc)
    if policy.on_error == "fail_closed" and not policy.shadow:
        raise GuardUnavailable(
            f"the {policy.name} guard could not judge this request; it was not served unscreened",
            retry_after=1,
        ) from exc


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
        unjudged(policy, ctx, exc)
        return Accept(detail=NOT_SCANNED)
