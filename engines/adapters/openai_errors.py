"""An OpenAI-compatible engine's refusals and failures as the gateway's own errors.

What an engine's error body says is read here (its message, ``Retry-After``), mapped to the gateway's
words where a 400 is one a client can fix; only an engine's error runs it.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson

from core.errors import EngineFailed, EngineRejected, EngineUnavailable, OmnigateError

_ERROR_BODY_LIMIT = 64 * 1024


async def status_error(resp: aiohttp.ClientResponse, engine: str) -> OmnigateError:
    """The error for an engine's answer other than 200."""
    raw = await resp.content.read(_ERROR_BODY_LIMIT)
    message = error_message(raw) or resp.reason or "error"
    retry_after = _retry_after(resp.headers.get("Retry-After"))
    text = f"engine {engine} answered {resp.status}: {message}"
    if resp.status in (429, 503):
        return EngineUnavailable(text, engine=engine, retry_after=retry_after)
    if resp.status >= 500:
        return EngineFailed(text, engine=engine)
    return rejection(text, message, engine=engine, upstream_status=resp.status)


# What an engine's 400 says, mapped to the gateway's own words: (pattern in its message, code, param, message).
# Its text itself never reaches the client (it names the engine's model, limits and internals).
_REJECTIONS: tuple[tuple[re.Pattern[str], str, str | None, str], ...] = (
    (
        re.compile(r"^'?max_(completion_)?tokens", re.IGNORECASE),
        "context_length_exceeded",
        "max_tokens",
        "max_tokens is more than the model's context window leaves for the answer; lower it",
    ),
    (
        re.compile(
            r"context length|model length|max_model_len|too long|maximum context|prompt \(length",
            re.IGNORECASE,
        ),
        "context_length_exceeded",
        "messages",
        "the messages and max_tokens together exceed the model's context window; shorten them",
    ),
    (
        re.compile(r"tool.?choice|tool.?call|tools", re.IGNORECASE),
        "engine_rejected_request",
        "tools",
        "the model does not accept these tools or this tool_choice",
    ),
    (
        re.compile(r"json.?schema|response.?format|grammar|guided|structured", re.IGNORECASE),
        "engine_rejected_request",
        "response_format",
        "the model does not accept this response_format",
    ),
    (
        re.compile(r"logprob", re.IGNORECASE),
        "engine_rejected_request",
        "top_logprobs",
        "the model does not return logprobs as asked",
    ),
    (
        re.compile(r"\bn must\b|\bn\b.*\bgreedy", re.IGNORECASE),
        "engine_rejected_request",
        "n",
        "the model cannot return n answers with these sampling settings (greedy decoding gives one)",
    ),
)


def rejection(detail: str, engine_message: str, *, engine: str, upstream_status: int) -> EngineRejected:
    """An engine's 4xx as the gateway's own error: the engine's words go to the log only."""
    for pattern, code, param, public in _REJECTIONS:
        if pattern.search(engine_message):
            return EngineRejected(
                detail, engine=engine, upstream_status=upstream_status, code=code, param=param, public=public
            )
    return EngineRejected(detail, engine=engine, upstream_status=upstream_status)


def error_message(raw: bytes | dict[str, Any]) -> str:
    """What an engine's error body or streamed error chunk says: its message (at most 500 characters), the
    start of a body that is not JSON, or ``""``."""
    try:
        doc = orjson.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
    except orjson.JSONDecodeError:
        return raw[:200].decode("utf-8", "replace").strip() if isinstance(raw, (bytes, bytearray)) else ""
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or "")[:500]
        return str(err)[:500]
    return ""


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
