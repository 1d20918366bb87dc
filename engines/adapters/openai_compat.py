"""Native adapter for OpenAI-compatible servers (vLLM): the hot path, on aiohttp.

One pooled ``aiohttp.ClientSession`` per engine; each chunk is parsed once with
orjson. Closing the stream closes the upstream connection, which is how vLLM
learns the client left; a stream that ended with ``[DONE]`` keeps its connection
(engines/adapters/openai_sse.py reads the rest of its body in the background).

This module is the request's shape (the allow-listed body, the request id sent
with it) and the calls. The engine's construction, start, close and probes are
engines/adapters/openai_control.py's; its SSE body is read in
engines/adapters/openai_sse.py, its chunks and whole answers in
engines/adapters/openai_read.py, its error answers in engines/adapters/openai_errors.py.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
import orjson
import structlog

from core.errors import EngineProtocolError, EngineTimeout, EngineUnavailable, OmnigateError
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from engines.adapters.base import Body, request_body, wire_messages
from engines.adapters.openai_control import OpenAICompatBase
from engines.adapters.openai_errors import rejection as rejection
from engines.adapters.openai_errors import status_error
from engines.adapters.openai_read import choice_delta, completion, translator
from engines.adapters.openai_sse import DONE, finish_body, sse_data
from observability.trace_spans import engine_headers

log = structlog.get_logger(__name__)


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
                    if data == DONE:
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
                    task = asyncio.get_running_loop().create_task(finish_body(resp))
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
        """A fresh per-stream translation function for a request of ``n`` choices."""
        return translator(self.name, n, self._choice_delta)

    def _choice_delta(
        self,
        chunk: dict[str, Any],
        choice: dict[str, Any],
        usage: dict[str, Any] | None,
        state: dict[str, Any],
    ) -> Delta | None:
        """One streamed choice as a Delta; an adapter whose chunks differ from OpenAI's reads them here."""
        return choice_delta(choice, usage, self.name)

    def _completion(self, doc: dict[str, Any], n: int) -> Completion:
        return completion(doc, n, self.name)


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
    A traced request's call also carries its attempt's W3C ``traceparent``, so the engine's spans join
    the gateway's trace (observability/tracing.py).

    The id is the one gateway/middleware.py made and bound to the log context (never the client's).
    """
    headers = dict(engine_headers())
    rid = structlog.contextvars.get_contextvars().get("request_id")
    if isinstance(rid, str) and rid:
        headers["X-Request-Id"] = _engine_request_id(rid)
    return headers


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
