"""OpenAI's response shapes, rendered from the pipeline's deltas.

Whatever the engine spoke, the client gets one choice, text in ``content`` (or,
when speech was asked for, in ``audio.transcript`` as OpenAI does), and speech
only in ``audio.data``. Text chunks use a prebuilt byte template: per-chunk work
is one ``orjson.dumps`` of the text.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import orjson

from core import audio as audio_codec
from core.context import RequestContext
from core.errors import OmnigateError
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest

DONE = b"data: [DONE]\n\n"
AUDIO_TTL_S = 3600
#: a usage extension: seconds of speech served, since speech adds no completion tokens (vLLM-Omni counts none)
AUDIO_SECONDS = "output_audio_seconds"
#: a usage extension: the answer's estimated GPU energy (its tokens times the engine's joules per token over
#: the signal window; engines/rollout/energy.py), only where the engine's GPU power is measured
ENERGY_JOULES = "energy_joules"


def error_frame(exc: OmnigateError) -> bytes:
    return b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n" + DONE


class ChunkRenderer:
    """Renders one stream's deltas as SSE frames. One instance per stream."""

    __slots__ = (
        "_audio_head",
        "_audio_id",
        "_audio_started",
        "_ctx",
        "_expires",
        "_finish",
        "_first",
        "_fmt",
        "_head",
        "_include_usage",
        "_others",
        "_speech",
        "_text_close",
        "_text_open",
    )

    def __init__(self, request: ChatCompletionRequest, ctx: RequestContext, completion_id: str) -> None:
        created = int(time.time())
        self._head = (
            b'data: {"id":'
            + orjson.dumps(completion_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(request.model)
            + b',"choices":'
        )
        self._speech = request.wants_audio
        self._audio_id = "audio_" + ctx.identity.request_id
        self._expires = created + AUDIO_TTL_S
        self._fmt = request.audio.format if request.audio is not None else "wav"
        self._audio_head = b'[{"index":0,"delta":{"audio":{"id":' + orjson.dumps(self._audio_id)
        if self._speech:
            self._text_open = self._audio_head + b',"transcript":'
            self._text_close = b'}},"finish_reason":null}]}\n\n'
        else:
            self._text_open = b'[{"index":0,"delta":{"content":'
            self._text_close = b'},"finish_reason":null}]}\n\n'
        self._audio_started = False
        self._first = True
        self._finish: str | None = None
        #: n > 1: the finish_reason of each choice after the first that has started (index -> reason)
        self._others: dict[int, str | None] = {}
        self._include_usage = request.include_usage
        self._ctx = ctx

    def _role(self) -> bytes:
        self._first = False
        return (
            self._head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
        )

    def render(self, d: Delta) -> bytes:
        if d.index:
            return self._other(d)
        out = self._role() if self._first else b""
        if d.tool_calls or d.reasoning or d.logprobs:
            out += self._rich(d)
        elif d.text:
            out += self._head + self._text_open + orjson.dumps(d.text) + self._text_close
        if d.audio:
            out += self._audio(d)
        if d.finish_reason is not None:
            self._finish = d.finish_reason
        return out

    def _other(self, d: Delta) -> bytes:
        """A piece of choice ``d.index`` > 0 (n > 1, never speech): its own role frame first, its own stop."""
        out = b""
        if d.index not in self._others:
            self._others[d.index] = None
            out = (
                self._head
                + b'[{"index":'
                + str(d.index).encode()
                + b',"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
            )
        if d.finish_reason is not None:
            self._others[d.index] = d.finish_reason
        if d.text or d.tool_calls or d.reasoning or d.logprobs:
            out += self._rich(d)
        return out

    def _rich(self, d: Delta) -> bytes:
        """A chunk carrying tool calls, reasoning or logprobs, in OpenAI's (and vLLM's) shape."""
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta[d.reasoning_key] = d.reasoning
        if d.text:
            if self._speech:
                delta["audio"] = {"id": self._audio_id, "transcript": d.text}
            else:
                delta["content"] = d.text
        if d.tool_calls:
            delta["tool_calls"] = d.tool_calls
        choice: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": None}
        if d.logprobs:
            choice["logprobs"] = {"content": d.logprobs}
        return self._head + orjson.dumps([choice]) + b"}\n\n"

    def _audio(self, d: Delta) -> bytes:
        pcm = d.audio
        if not self._audio_started:
            self._audio_started = True
            if self._fmt == "wav":
                pcm = audio_codec.wav_header(d.sample_rate, d.channels) + pcm
        return (
            self._head
            + self._audio_head
            + b',"data":'
            + orjson.dumps(base64.b64encode(pcm).decode("ascii"))
            + b',"expires_at":'
            + str(self._expires).encode()
            + b'}},"finish_reason":null}]}\n\n'
        )

    def final(self) -> bytes:
        """The finishing chunk (carrying the policies' notes as a top-level ``omnigate`` field), usage, [DONE]."""
        out = self._role() if self._first else b""
        notes = b',"omnigate":' + orjson.dumps(self._ctx.outputs.notes) if self._ctx.outputs.notes else b""
        for index, finish in sorted(self._others.items()):
            out += (
                self._head
                + b'[{"index":'
                + str(index).encode()
                + b',"delta":{},"finish_reason":'
                + orjson.dumps(finish or "stop")
                + b"}]}\n\n"
            )
        out += (
            self._head
            + b'[{"index":0,"delta":{},"finish_reason":'
            + orjson.dumps(self._finish or "stop")
            + b"}]"
            + notes
            + b"}\n\n"
        )
        if self._include_usage:
            ctx = self._ctx
            usage: dict[str, Any] = {
                "prompt_tokens": ctx.record.prompt_tokens,
                "completion_tokens": ctx.record.completion_tokens,
                "total_tokens": ctx.record.prompt_tokens + ctx.record.completion_tokens,
            }
            if self._speech:
                usage[AUDIO_SECONDS] = round(ctx.record.audio_seconds, 3)
            if ctx.record.energy_joules is not None:
                usage[ENERGY_JOULES] = round(ctx.record.energy_joules, 3)
            out += self._head + b'[],"usage":' + orjson.dumps(usage) + b"}\n\n"
        return out + DONE


def _text_choice(index: int, completion: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.text}
    if completion.tool_calls:
        message["tool_calls"] = completion.tool_calls
        if not completion.text:
            message["content"] = None
    if completion.reasoning:
        message[completion.reasoning_key] = completion.reasoning
    return {
        "index": index,
        "message": message,
        "finish_reason": completion.finish_reason,
        "logprobs": {"content": completion.logprobs} if completion.logprobs else None,
    }


def completion_body(
    request: ChatCompletionRequest, completion: Completion, ctx: RequestContext, completion_id: str
) -> dict[str, Any]:
    first = _text_choice(0, completion)
    message = first["message"]
    if request.wants_audio and completion.audio:
        fmt = request.audio.format if request.audio is not None else "wav"
        data = audio_codec.encode(completion.audio, completion.sample_rate, completion.channels, fmt)
        message["audio"] = {
            "id": "audio_" + ctx.identity.request_id,
            "data": base64.b64encode(data).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_TTL_S,
            "transcript": completion.transcript or completion.text,
        }
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [first, *(_text_choice(i, alt) for i, alt in enumerate(completion.alternatives, start=1))],
        "usage": completion.usage.to_dict(),
    }
    if request.wants_audio:
        body["usage"][AUDIO_SECONDS] = round(ctx.record.audio_seconds, 3)
    if ctx.record.energy_joules is not None:
        body["usage"][ENERGY_JOULES] = round(ctx.record.energy_joules, 3)
    if ctx.outputs.notes:
        body["omnigate"] = ctx.outputs.notes
    return body


def response_headers(ctx: RequestContext) -> dict[str, str]:
    """The response's own headers: what verdicts added, the degradations, and ``x-omnigate-guards``: each
    policy that ran before the response started, with its last verdict (``;shadow`` for a shadow one),
    names and verdicts only; the receipts themselves are in the audit record."""
    headers = dict(ctx.outputs.response_headers)
    if ctx.outputs.degraded:
        headers["x-omnigate-degraded"] = ",".join(ctx.outputs.degraded)
    runs = ctx.record.policy_runs
    if runs:
        last = {run.name: run.verdict + (";shadow" if run.shadow else "") for run in runs}
        headers["x-omnigate-guards"] = ", ".join(f"{name}={verdict}" for name, verdict in last.items())
    return headers
