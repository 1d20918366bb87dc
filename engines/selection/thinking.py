"""The thinking budget: what one engine is sent for a request's reasoning tokens, and what it cannot honour.

An engine that enforces a budget (``Capabilities.thinking_budget``: vLLM served with
``--reasoning-parser`` and ``--reasoning-config``) is sent ``thinking_token_budget`` =
min(requested, the engine's ``max_thinking_tokens``), that cap when the request sets none,
and nothing when the request turns thinking off. Anywhere else thinking tokens count
against ``max_tokens``, the only bound there is: a client budget below the request's
``max_tokens`` cannot be kept (no engine of the model that enforces one: a 400), and
``max_tokens`` is held to ``max_thinking_tokens`` while thinking is not off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.errors import InvalidRequest

if TYPE_CHECKING:
    from core.schemas import ChatCompletionRequest
    from engines.adapters.base import Engine


class ThinkingBudgetUnsupported(InvalidRequest):
    code = "thinking_budget_unsupported"


def needs_enforcement(request: ChatCompletionRequest) -> bool:
    """The client's budget is tighter than what max_tokens already bounds: only an engine can keep it."""
    budget = request.thinking_token_budget
    if budget is None or request.thinking_off:
        return False
    limit = request.output_token_limit
    return limit is None or budget < limit


def refuse(request: ChatCompletionRequest) -> ThinkingBudgetUnsupported:
    return ThinkingBudgetUnsupported(
        f"the model {request.model!r} cannot enforce a thinking_token_budget; its thinking is bounded only "
        "by max_tokens: set max_tokens to at most the budget, or leave thinking_token_budget out",
        param="thinking_token_budget",
    )


def fit(engine: Engine, request: ChatCompletionRequest) -> tuple[ChatCompletionRequest, str | None]:
    """The request as ``engine`` is sent it, and the degradation it carries (None: as asked)."""
    cap = engine.config.max_thinking_tokens
    asked = request.thinking_token_budget
    if engine.capabilities.thinking_budget:
        if request.thinking_off:
            return (
                request.model_copy(update={"thinking_token_budget": None}) if asked is not None else request
            ), None
        if asked is None:
            return request.model_copy(update={"thinking_token_budget": cap}), None
        if asked > cap:
            return request.model_copy(update={"thinking_token_budget": cap}), "thinking-budget-capped"
        return request, None
    # Not sent: the engine would refuse or ignore it. max_tokens keeps the engine's cap instead.
    fitted = request.model_copy(update={"thinking_token_budget": None}) if asked is not None else request
    limit = request.output_token_limit
    if request.thinking_off or (limit is not None and limit <= cap):
        return fitted, None
    held = fitted.model_copy(update={"max_tokens": cap, "max_completion_tokens": None})
    return held, None if limit is None else "thinking-budget-as-max-tokens"
