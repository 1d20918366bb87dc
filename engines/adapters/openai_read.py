"""An OpenAI-compatible engine's documents read into the gateway's events: a streamed chunk into a
:class:`core.events.Delta`, a whole answer into a :class:`core.events.Completion`.

Only OpenAI's fields are kept (an engine's extras stay here); a choice's or a tool call's index is checked
before anything reads it. The engine that sends them is
:class:`engines.adapters.openai_compat.OpenAICompatEngine`, which vLLM-Omni's adapter extends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import EngineError, EngineProtocolError
from core.events import Completion, Delta, Usage
from core.schemas import MAX_TOOL_CALLS
from engines.adapters.base import checked_index
from engines.adapters.openai_errors import error_message

#: one streamed choice as a Delta, or None: (chunk, choice, usage, the stream's state)
ChoiceReader = Callable[[dict[str, Any], dict[str, Any], dict[str, Any] | None, dict[str, Any]], Delta | None]


def translator(name: str, n: int, choice_delta: ChoiceReader) -> Callable[[dict[str, Any]], Delta | None]:
    """A fresh per-stream translation function for engine ``name`` and a request of ``n`` choices, each
    choice read by ``choice_delta``; per-stream state lives in its closure."""
    state: dict[str, Any] = {}

    def translate(chunk: dict[str, Any]) -> Delta | None:
        if not isinstance(chunk, dict):
            raise EngineProtocolError(f"engine {name} sent a chunk that is not an object", engine=name)
        if "error" in chunk:
            raise EngineError(f"engine {name} reported: {error_message(chunk)}", engine=name)
        usage = chunk.get("usage")
        choices = chunk.get("choices")
        if not choices:
            return Delta(usage=read_usage(usage)) if usage else None
        choice = choices[0] if isinstance(choices, list) else None
        if not isinstance(choice, dict):
            raise EngineProtocolError(f"engine {name} sent a choice that is not an object", engine=name)
        # Checked before anything reads it: the relay and the renderer file pieces by it (n > 1).
        checked_index(choice.get("index", 0), n, "a choice", name)
        return choice_delta(chunk, choice, usage, state)

    return translate


def choice_delta(choice: dict[str, Any], usage: dict[str, Any] | None, name: str) -> Delta | None:
    """One streamed choice as a Delta (OpenAI's shape: text in ``delta.content``, calls in ``tool_calls``)."""
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    finish = choice.get("finish_reason")
    calls = delta.get("tool_calls")
    # Most pieces are plain text: the reasoning keys are looked for only where one is present.
    if "reasoning_content" in delta or "reasoning" in delta:
        reasoning, key = _reasoning(delta)
    else:
        reasoning, key = "", "reasoning_content"
    lp = choice.get("logprobs")
    index = choice.get("index", 0)  # n > 1: vLLM streams each choice's pieces under its index (checked)
    if not (text or calls or reasoning or lp):
        if finish is None and not usage:
            return None
        return Delta(finish_reason=finish, usage=read_usage(usage) if usage else None, index=index)
    if not (calls or reasoning or lp or usage):
        return Delta(text=text, finish_reason=finish, index=index)
    return Delta(
        text=text,
        finish_reason=finish,
        usage=read_usage(usage) if usage else None,
        tool_calls=[_call_fragment(c, name) for c in calls] if calls else None,
        reasoning=reasoning,
        reasoning_key=key,
        logprobs=_logprob_entries(lp),
        index=index,
    )


def completion(doc: dict[str, Any], n: int, name: str) -> Completion:
    """A whole answer of ``n`` choices from engine ``name``: the first, with the rest as its alternatives."""
    # By index, not position: choices of n > 1 are the client's choices 0..n-1, each once.
    indexes = [checked_index(c.get("index", 0), n, "a choice", name) for c in doc["choices"]]
    if not indexes or len(set(indexes)) != len(indexes):
        raise EngineProtocolError(f"engine {name} sent choices {indexes[:8]} for n={n}", engine=name)
    choices = [c for _, c in sorted(zip(indexes, doc["choices"], strict=True), key=lambda ic: ic[0])]
    first, *rest = [choice_completion(c) for c in choices]
    first.usage = read_usage(doc.get("usage") or {})
    first.alternatives = rest
    return first


def choice_completion(choice: dict[str, Any]) -> Completion:
    """One choice of a whole answer (its message's text, calls, reasoning and logprobs)."""
    message = choice.get("message") or {}
    reasoning, key = _reasoning(message)
    return Completion(
        text=message.get("content") or "",
        finish_reason=choice.get("finish_reason") or "stop",
        tool_calls=[_whole_call(c) for c in message.get("tool_calls") or ()],
        reasoning=reasoning,
        reasoning_key=key,
        logprobs=_logprob_entries(choice.get("logprobs")),
    )


def _reasoning(part: dict[str, Any]) -> tuple[str, str]:
    """Reasoning text and the key it came under (vLLM has used both names)."""
    for key in ("reasoning_content", "reasoning"):
        value = part.get(key)
        if value:
            return value, key
    return "", "reasoning_content"


def _call_fragment(raw: dict[str, Any], engine: str) -> dict[str, Any]:
    """A streamed tool-call fragment, keeping only OpenAI's fields (an engine's extras stay here).

    Its index places it among the answer's calls (core/events.merge_tool_calls grows a list to it).
    """
    if not isinstance(raw, dict):
        raise EngineProtocolError(f"engine {engine} sent a tool call that is not an object", engine=engine)
    out: dict[str, Any] = {"index": checked_index(raw.get("index", 0), MAX_TOOL_CALLS, "a tool call", engine)}
    if raw.get("id"):
        out["id"] = raw["id"]
        out["type"] = "function"
    fn = raw.get("function")
    if isinstance(fn, dict):
        out["function"] = {k: fn[k] for k in ("name", "arguments") if isinstance(fn.get(k), str)}
    return out


def _whole_call(raw: dict[str, Any]) -> dict[str, Any]:
    fn = raw.get("function") or {}
    return {
        "id": raw.get("id") or "",
        "type": "function",
        "function": {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
    }


def _logprob_entries(raw: Any) -> list[dict[str, Any]] | None:
    content = raw.get("content") if isinstance(raw, dict) else None
    return content if isinstance(content, list) and content else None


def read_usage(raw: dict[str, Any]) -> Usage:
    """The token counts of an engine's ``usage`` object (0 for one it leaves out)."""
    return Usage(raw.get("prompt_tokens") or 0, raw.get("completion_tokens") or 0)
