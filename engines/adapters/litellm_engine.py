"""Adapter for any provider litellm reaches, for fallbacks to hosted APIs.

litellm is imported on first use (it is heavy); its exceptions are mapped once,
here, onto the gateway's error tree. It drops vLLM-Omni's ``modality`` tag, so
vLLM-Omni engines use their own adapter instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncGenerator
from typing import Any

from core.errors import EngineError, EngineRejected, EngineTimeout, EngineUnavailable, OmnigateError
from core.events import Completion, Delta, Usage
from core.schemas import FEATURE_FIELDS, MAX_TOOL_CALLS, VLLM_EXTRA_FIELDS, ChatCompletionRequest
from engines.adapters.base import checked_index, declared, whole_strings, wire_messages
from engines.adapters.openai_compat import request_id_header
from engines.adapters.settings import EngineConfig

_PASS = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "reasoning_effort",
)
_PASS_MODELS = ("tool_choice", "response_format")
#: the provider prefix of a vLLM server behind litellm: the one provider that takes vLLM's extras
_VLLM_PROVIDER = "hosted_vllm/"


def _litellm() -> Any:
    # litellm downloads a price map at import unless told to use its bundled copy.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    import litellm

    return litellm


class LiteLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.name = config.name
        self.config = config
        # litellm maps these onto each provider, and raises (a 400 here) for one that lacks them. vLLM's
        # own extras only a vLLM server takes: for any other provider a request setting one is refused.
        self.extras = VLLM_EXTRA_FIELDS if config.model.startswith(_VLLM_PROVIDER) else ()
        self.capabilities = declared(config, features=frozenset((*FEATURE_FIELDS, *self.extras)))
        self._lib: Any = None

    async def start(self) -> None:
        self._lib = _litellm()

    async def aclose(self) -> None:
        return None

    async def health(self) -> bool:
        # Hosted providers have no cheap health endpoint; passive outcomes decide.
        return self._lib is not None

    def _kwargs(self, request: ChatCompletionRequest, stream: bool) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": self.config.model,
            "messages": whole_strings(wire_messages(request)),
            "stream": stream,
            "timeout": self.config.first_byte_timeout_s + self.config.read_timeout_s,
            "num_retries": 0,
        }
        if stream:
            kw["stream_options"] = {"include_usage": True}
        if self.config.base_url is not None:
            kw["api_base"] = str(self.config.base_url).rstrip("/")
        if self.config.api_key is not None:
            kw["api_key"] = self.config.api_key.get_secret_value()
        headers = request_id_header()
        if headers:
            kw["extra_headers"] = headers  # joins the engine's log lines to the gateway's (vLLM adopts it)
        if request.output_token_limit is not None:
            kw["max_tokens"] = request.output_token_limit
        for key in _PASS:
            value = getattr(request, key)
            if value is not None:
                kw[key] = value
        for key in _PASS_MODELS:
            value = getattr(request, key)
            if value is not None:
                kw[key] = (
                    value if isinstance(value, str) else value.model_dump(exclude_none=True, by_alias=True)
                )
        if request.tools is not None:
            kw["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
        extra: dict[str, Any] = {}
        for key in self.extras:
            value = getattr(request, key)
            if value is not None and not key.startswith("guided_") and key != "structured_outputs":
                extra[key] = value
        structured = request.structured() if self.extras else None
        if structured is not None:
            extra["structured_outputs"] = structured
        if extra:
            kw["extra_body"] = extra  # sent to the vLLM server as top-level fields, as the client meant them
        return kw

    def _map(self, exc: Exception) -> OmnigateError:
        lib = self._lib
        status = getattr(exc, "status_code", None)
        text = f"engine {self.name} failed: {type(exc).__name__}"
        if isinstance(exc, lib.exceptions.Timeout):
            return EngineTimeout(text, engine=self.name)
        if isinstance(
            exc,
            (
                lib.exceptions.RateLimitError,
                lib.exceptions.ServiceUnavailableError,
                lib.exceptions.APIConnectionError,
                lib.exceptions.InternalServerError,
            ),
        ):
            return EngineUnavailable(text, engine=self.name)
        if isinstance(status, int) and 400 <= status < 500 and status not in (401, 403, 429):
            return EngineRejected(text, engine=self.name, upstream_status=status)
        if isinstance(status, int) and status >= 500:
            return EngineUnavailable(text, engine=self.name)
        return EngineError(text, engine=self.name)

    async def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
        lib = self._lib
        response = None
        try:
            response = await lib.acompletion(**self._kwargs(request, stream=True))
            async for chunk in response:
                usage = getattr(chunk, "usage", None)
                choices = chunk.choices or []
                if choices:
                    # litellm passes the provider's index through unchecked; only choice 0 is read here
                    checked_index(getattr(choices[0], "index", 0), request.choices, "a choice", self.name)
                delta = choices[0].delta if choices else None
                text = (delta.content or "") if delta is not None else ""
                finish = choices[0].finish_reason if choices else None
                calls = _plain(getattr(delta, "tool_calls", None)) if delta is not None else None
                reasoning = (getattr(delta, "reasoning_content", None) or "") if delta is not None else ""
                logprobs = _plain(getattr(choices[0], "logprobs", None)) if choices else None
                if (
                    not text
                    and finish is None
                    and usage is None
                    and not calls
                    and not reasoning
                    and not logprobs
                ):
                    continue
                yield Delta(
                    text=text,
                    finish_reason=finish,
                    usage=Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0) if usage else None,
                    tool_calls=[_fragment(c, self.name) for c in calls] if calls else None,
                    reasoning=reasoning,
                    logprobs=(logprobs or {}).get("content") or None,
                )
        except OmnigateError:
            raise
        except Exception as exc:
            if lib is not None and isinstance(exc, lib.exceptions.OpenAIError | lib.exceptions.APIError):
                raise self._map(exc) from exc
            if isinstance(exc, (OSError, TimeoutError)):
                raise EngineUnavailable(
                    f"engine {self.name} failed: {type(exc).__name__}", engine=self.name
                ) from exc
            raise
        finally:
            close = getattr(response, "aclose", None)
            if close is not None:
                with contextlib.suppress(
                    Exception
                ):  # closing a broken stream may raise again; it is already gone
                    await close()

    async def complete(self, request: ChatCompletionRequest) -> Completion:
        lib = self._lib
        try:
            resp = await lib.acompletion(**self._kwargs(request, stream=False))
        except Exception as exc:
            if isinstance(exc, lib.exceptions.OpenAIError | lib.exceptions.APIError):
                raise self._map(exc) from exc
            raise
        for c in resp.choices:
            checked_index(getattr(c, "index", 0), request.choices, "a choice", self.name)
        choice = resp.choices[0]
        usage = getattr(resp, "usage", None)
        calls = _plain(getattr(choice.message, "tool_calls", None)) or []
        logprobs = _plain(getattr(choice, "logprobs", None)) or {}
        return Completion(
            text=choice.message.content or "",
            finish_reason=choice.finish_reason or "stop",
            usage=Usage(getattr(usage, "prompt_tokens", 0) or 0, getattr(usage, "completion_tokens", 0) or 0),
            tool_calls=[
                {
                    "id": c.get("id") or "",
                    "type": "function",
                    "function": {
                        "name": (c.get("function") or {}).get("name") or "",
                        "arguments": (c.get("function") or {}).get("arguments") or "",
                    },
                }
                for c in calls
            ],
            reasoning=getattr(choice.message, "reasoning_content", None) or "",
            logprobs=logprobs.get("content") or None if isinstance(logprobs, dict) else None,
        )


def _plain(obj: Any) -> Any:
    """litellm's pydantic objects (or plain values) as plain JSON values."""
    if obj is None:
        return None
    if isinstance(obj, list):
        return [_plain(o) for o in obj]
    dump = getattr(obj, "model_dump", None)
    return dump() if callable(dump) else obj


def _fragment(raw: dict[str, Any], engine: str) -> dict[str, Any]:
    out: dict[str, Any] = {"index": checked_index(raw.get("index", 0), MAX_TOOL_CALLS, "a tool call", engine)}
    if raw.get("id"):
        out["id"], out["type"] = raw["id"], "function"
    fn = raw.get("function") or {}
    out["function"] = {k: fn[k] for k in ("name", "arguments") if isinstance(fn.get(k), str)}
    return out
