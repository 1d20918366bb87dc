"""Native adapter for OpenAI-compatible servers (vLLM): the hot path, on aiohttp.

One pooled ``aiohttp.ClientSession`` per engine; each chunk is parsed once with
orjson. Closing the stream closes the upstream connection, which is how vLLM
learns the client left.

A stream that ended with ``[DONE]`` keeps its connection: the chunked body's
terminator often arrives in a segment of its own just after ``[DONE]`` (uvicorn,
under vLLM, writes it separately), and aiohttp closes a connection released
before its body ended. So the rest of the body is read in the background (at most
``_DRAIN_BYTES`` within ``_DRAIN_S``) and the connection goes back to the pool;
the client's stream does not wait for it. Without this, a share of requests paid
a new TCP connection to the engine on their way to the first token.

The engine's construction, start, close and probes are engines/adapters/openai_control.py's; its error
answers are read in engines/adapters/openai_errors.py.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import structlog

from core.errors import (
    EngineError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    OmnigateError,
)
from core.events import Completion, Delta, Usage
from core.schemas import MAX_TOOL_CALLS, ChatCompletionRequest
from engines.adapters.base import Body, checked_index, request_body, wire_messages
from engines.adapters.openai_control import OpenAICompatBase
from engines.adapters.openai_errors import _error_message, status_error
from engines.adapters.openai_errors import rejection as rejection

log = structlog.get_logger(__name__)

_DATA = b"data:"
_DONE = b"[DONE]"
# One SSE line may carry a large audio chunk (base64), never megabytes of it.
_MAX_LINE_BYTES = 16 * 1024 * 1024
# What may follow [DONE] before the body's end (its terminator; a server's trailing bytes), and how long.
_DRAIN_BYTES = 64 * 1024
_DRAIN_S = 2.0


async def sse_data(content: aiohttp.StreamReader, engine: str) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of an SSE body, a batch per read: every complete line that read brought.

    One read of the socket usually holds several events (an engine streaming faster
    than the gateway reads); splitting them here costs one ``bytes.split`` instead of
    two ``readline`` calls per event. Lines end with ``\n`` (a ``\r`` before it is
    stripped); an unterminated line longer than ``_MAX_LINE_BYTES`` is a protocol error.
    """
    tail = b""
    async for chunk in content.iter_any():
        if tail:
            chunk = tail + chunk
        if b"\n" not in chunk:
            tail = chunk
        else:
            *lines, tail = chunk.split(b"\n")
            batch = [line[5:].strip() for line in lines if line.startswith(_DATA)]
            if batch:
                yield batch
        if len(tail) > _MAX_LINE_BYTES:
            raise EngineProtocolError(
                f"engine {engine} sent an SSE line over {_MAX_LINE_BYTES} bytes", engine=engine
            )
    if tail.startswith(_DATA):
        yield [tail[5:].strip()]


async def _finish_body(resp: aiohttp.ClientResponse) -> None:
    """Read what is left of a body after ``[DONE]`` so its connection can be reused; close it otherwise."""
    reusable = False
    try:
        left = _DRAIN_BYTES
        async with asyncio.timeout(_DRAIN_S):
            while left > 0 and (chunk := await resp.content.readany()):
                left -= len(chunk)
        reusable = resp.content.is_eof()
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        if reusable:
            resp.release()
        else:
            resp.close()


class OpenAICompatEngine(OpenAICompatBase):
    """An engine that speaks plain OpenAI chat completions (kind ``vllm``)."""

    # -- request shape ---------------------------------------------------
    def payload(self, request: ChatCompletionRequest, *, stream: bool) -> dict[str, Any]:
        """The allow-listed body sent upstream; nothing else from the client passes."""
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": wire_messages(request),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        limit = request.output_token_limit
        if limit is not None:
            # vLLM refuses a max_tokens above its max_model_len outright (and clamps one within it), so a
            # cap the gateway set for every engine must not turn a short answer into a 400 on a small one.
            body["max_tokens"] = min(limit, self.config.max_context_tokens)
        for key in _PASS:
            value = getattr(request, key)
            if value is not None:
                body[key] = value
        if self.capabilities.thinking_budget and request.thinking_token_budget is not None:
            # Only here: vLLM refuses the field outright when it was not served with a reasoning config.
            body["thinking_token_budget"] = request.thinking_token_budget
        for key in self.extras:
            value = getattr(request, key)
            if value is not None and key in _PASS_EXTRAS:
                body[key] = value
        structured = request.structured() if "structured_outputs" in self.extras else None
        if structured is not None:
            body["structured_outputs"] = structured  # the guided_* fields too: vLLM has removed them
        for key in _PASS_MODELS:
            value = getattr(request, key)
            if value is not None:
                body[key] = (
                    value if isinstance(value, str) else value.model_dump(exclude_none=True, by_alias=True)
                )
        if request.tools is not None:
            body["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
        if request.choices > 1:
            body["n"] = request.choices
        if request.modalities is not None:
            body["modalities"] = list(request.modalities)
        if request.wants_audio and request.audio is not None:
            self._add_audio(body, request)
        return body

    def _add_audio(self, body: dict[str, Any], request: ChatCompletionRequest) -> None:
        assert request.audio is not None
        body["audio"] = {"voice": request.audio.voice, "format": request.audio.format}

    # -- calls -----------------------------------------------------------
    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineUnavailable(f"engine {self.name} is not started", engine=self.name)
        return self._session

    async def _check_status(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status != 200:
            raise await status_error(resp, self.name)

    async def stream(self, request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
        session = self._require_session()
        body = request_body(self.payload(request, stream=True))
        resp: aiohttp.ClientResponse | None = None
        finished = False
        try:
            try:
                async with asyncio.timeout(self.config.first_byte_timeout_s):
                    resp = await session.post(
                        self._url, data=_sent(body), headers={**self._headers, **request_id_header()}
                    )
                    await self._check_status(resp)
            except TimeoutError as exc:
                raise EngineTimeout(
                    f"engine {self.name} sent no response within {self.config.first_byte_timeout_s} s",
                    engine=self.name,
                ) from exc
            translate = self._translator(request.choices)
            async for batch in sse_data(resp.content, self.name):
                # The pieces one read brought are translated together and go on marked as such (each but the
                # last says another follows: the relay writes them to the client at once); a bad event in
                # the read is raised after the pieces before it, in the order the engine sent them.
                deltas: list[Delta] = []
                failure: OmnigateError | None = None
                for data in batch:
                    if data == _DONE:
                        finished = True
                        break
                    try:
                        delta = translate(orjson.loads(data))
                    except orjson.JSONDecodeError as exc:
                        failure = EngineProtocolError(
                            f"engine {self.name} sent malformed JSON", engine=self.name
                        )
                        failure.__cause__ = exc
                        break
                    except OmnigateError as exc:
                        failure = exc
                        break
                    if delta is not None:
                        deltas.append(delta)
                last = len(deltas) - 1
                for i, delta in enumerate(deltas):
                    delta.more = i < last
                    yield delta
                if failure is not None:
                    raise failure
                if finished:
                    break
            if not finished:
                raise EngineUnavailable(f"engine {self.name} ended the stream early", engine=self.name)
        except OmnigateError:
            raise
        except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
            raise EngineTimeout(f"engine {self.name} timed out", engine=self.name) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(
                f"engine {self.name} failed: {type(exc).__name__}", engine=self.name
            ) from exc
        finally:
            if resp is not None:
                if not finished:
                    # Dropping the connection is what tells vLLM to abort the request.
                    resp.close()
                elif resp.content.is_eof():
                    resp.release()
                else:
                    task = asyncio.get_running_loop().create_task(_finish_body(resp))
                    self._draining.add(task)
                    task.add_done_callback(self._draining.discard)

    async def complete(self, request: ChatCompletionRequest) -> Completion:
        session = self._require_session()
        body = request_body(self.payload(request, stream=False))
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s + self.config.read_timeout_s):
                async with session.post(
                    self._url, data=_sent(body), headers={**self._headers, **request_id_header()}
                ) as resp:
                    await self._check_status(resp)
                    raw = await resp.read()
        except OmnigateError:
            raise
        except TimeoutError as exc:
            raise EngineTimeout(f"engine {self.name} timed out", engine=self.name) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(
                f"engine {self.name} failed: {type(exc).__name__}", engine=self.name
            ) from exc
        try:
            doc = orjson.loads(raw)
            return self._completion(doc, request.choices)
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise EngineProtocolError(
                f"engine {self.name} sent an unexpected response", engine=self.name
            ) from exc

    # -- translation -----------------------------------------------------
    def _translator(self, n: int) -> Callable[[dict[str, Any]], Delta | None]:
        """A fresh per-stream translation function for a request of ``n`` choices; per-stream state
        lives in its closure."""
        name = self.name
        state: dict[str, Any] = {}
        choice_delta = self._choice_delta

        def translate(chunk: dict[str, Any]) -> Delta | None:
            if not isinstance(chunk, dict):
                raise EngineProtocolError(f"engine {name} sent a chunk that is not an object", engine=name)
            if "error" in chunk:
                raise EngineError(f"engine {name} reported: {_error_message(chunk)}", engine=name)
            usage = chunk.get("usage")
            choices = chunk.get("choices")
            if not choices:
                return Delta(usage=_usage(usage)) if usage else None
            choice = choices[0] if isinstance(choices, list) else None
            if not isinstance(choice, dict):
                raise EngineProtocolError(f"engine {name} sent a choice that is not an object", engine=name)
            # Checked before anything reads it: the relay and the renderer file pieces by it (n > 1).
            checked_index(choice.get("index", 0), n, "a choice", name)
            return choice_delta(chunk, choice, usage, state)

        return translate

    def _choice_delta(
        self,
        chunk: dict[str, Any],
        choice: dict[str, Any],
        usage: dict[str, Any] | None,
        state: dict[str, Any],
    ) -> Delta | None:
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
            return Delta(finish_reason=finish, usage=_usage(usage) if usage else None, index=index)
        if not (calls or reasoning or lp or usage):
            return Delta(text=text, finish_reason=finish, index=index)
        return Delta(
            text=text,
            finish_reason=finish,
            usage=_usage(usage) if usage else None,
            tool_calls=[_call_fragment(c, self.name) for c in calls] if calls else None,
            reasoning=reasoning,
            reasoning_key=key,
            logprobs=_logprob_entries(lp),
            index=index,
        )

    def _completion(self, doc: dict[str, Any], n: int) -> Completion:
        # By index, not position: choices of n > 1 are the client's choices 0..n-1, each once.
        indexes = [checked_index(c.get("index", 0), n, "a choice", self.name) for c in doc["choices"]]
        if not indexes or len(set(indexes)) != len(indexes):
            raise EngineProtocolError(
                f"engine {self.name} sent choices {indexes[:8]} for n={n}", engine=self.name
            )
        choices = [c for _, c in sorted(zip(indexes, doc["choices"], strict=True), key=lambda ic: ic[0])]
        first, *rest = [_choice_completion(c) for c in choices]
        first.usage = _usage(doc.get("usage") or {})
        first.alternatives = rest
        return first


# Sampling fields passed as the client set them; the models below are dumped by their wire names.
_PASS = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "top_k",
    "repetition_penalty",
    "chat_template_kwargs",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "reasoning_effort",
)
_PASS_MODELS = ("tool_choice", "response_format")
#: vLLM's extras passed as set (structured outputs go as one ``structured_outputs``, the old names included)
_PASS_EXTRAS = frozenset(
    {"min_p", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
     "include_stop_str_in_output", "priority"}
)  # fmt: skip


def request_id_header() -> dict[str, str]:
    """The gateway's request id as ``X-Request-Id``, which vLLM adopts as its own request id, so the
    engine's log lines join the gateway's; empty outside a request (health probes, the accuracy replay).

    The id is the one gateway/middleware.py made and bound to the log context (never the client's).
    """
    rid = structlog.contextvars.get_contextvars().get("request_id")
    if not isinstance(rid, str) or not rid:
        return {}
    return {"X-Request-Id": _engine_request_id(rid)}


#: engine calls made so far per recent request id (bounded: oldest forgotten first)
_CALLS: collections.OrderedDict[str, int] = collections.OrderedDict()
_CALLS_KEPT = 4096


def _engine_request_id(rid: str) -> str:
    """``rid`` for a request's first engine call, ``rid-2``, ``rid-3`` ... for its retries and failovers.

    vLLM refuses a request id that is still running ("Request id ... already running"), and an attempt
    aborted a moment ago may still be in its engine when the retry arrives; the suffix keeps each call
    unique while a grep for the gateway's id still finds every one of them.
    """
    n = _CALLS.pop(rid, 0) + 1
    _CALLS[rid] = n
    while len(_CALLS) > _CALLS_KEPT:
        _CALLS.popitem(last=False)
    return rid if n == 1 else f"{rid}-{n}"


def _sent(body: bytes | Body) -> Any:
    """What aiohttp writes: the bytes, or a media body's pieces as the connection drains them."""
    return body if isinstance(body, bytes) else body.stream()


def _choice_completion(choice: dict[str, Any]) -> Completion:
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


def _usage(raw: dict[str, Any]) -> Usage:
    return Usage(raw.get("prompt_tokens") or 0, raw.get("completion_tokens") or 0)
