"""The normalised events every engine adapter yields and the pipeline, policies and audit read.

:class:`Delta` is one piece of a streamed answer, :class:`Completion` a whole one, :class:`Usage`
their token counts. Text is text and audio is PCM16 bytes: they cannot be confused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


@dataclass(slots=True)
class Delta:
    """One normalised piece of an engine's answer.

    ``audio`` is 16-bit little-endian PCM at ``sample_rate`` (mono unless
    ``channels`` says otherwise); ``transcript`` is the text that audio speaks.
    ``finish_reason`` is set on the text stream's last piece; audio that ends
    later carries ``audio_done``.

    ``tool_calls`` are the engine's streamed tool-call fragments as OpenAI shapes
    them (``index``, then ``id``/``type``/``function.name`` once and
    ``function.arguments`` in pieces); ``reasoning`` is reasoning text, relayed
    under the key the engine used (``reasoning_key``); ``logprobs`` the entries of
    the choice's ``logprobs.content`` that came with this piece.
    """

    text: str = ""
    audio: bytes = b""
    transcript: str = ""
    sample_rate: int = 0
    channels: int = 1
    finish_reason: str | None = None
    audio_done: bool = False
    usage: Usage | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str = ""
    reasoning_key: str = "reasoning_content"
    logprobs: list[dict[str, Any]] | None = None
    #: the choice this piece belongs to (``n`` > 1); 0 otherwise
    index: int = 0
    #: another piece follows at once (the engine's read brought it with this one): the transport may write
    #: them to the client together. False promises nothing; a piece is never held back waiting on it.
    more: bool = False

    @property
    def output_pieces(self) -> int:
        """How many generated pieces this delta carries (each at least one token): the output cap's unit."""
        n = 1 if self.text else 0
        if self.reasoning:
            n += 1
        for call in self.tool_calls or ():
            fn = call.get("function") or {}
            if fn.get("arguments") or fn.get("name"):
                n += 1
        return n


@dataclass(slots=True)
class Completion:
    """A whole answer, for clients that did not ask to stream."""

    text: str = ""
    audio: bytes = b""
    transcript: str = ""
    sample_rate: int = 0
    channels: int = 1
    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    #: whole tool calls (``id``, ``type``, ``function.name``, ``function.arguments``), in index order
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""
    reasoning_key: str = "reasoning_content"
    logprobs: list[dict[str, Any]] | None = None
    #: the other answers of a non-streamed request with ``n`` > 1 (choices 1..n-1)
    alternatives: list[Completion] = field(default_factory=list)
    #: the streamed pieces of the answer (choice 0) that carried text, speech or a call: what a stream cut
    #: before the engine's usage came is counted by (one token a piece, as vLLM streams its tokens)
    pieces: int = 0

    def add(self, d: Delta) -> None:
        """Fold a streamed delta into this completion (a piece of choice ``i`` > 0 into its alternative)."""
        if d.index:
            while len(self.alternatives) < d.index:
                self.alternatives.append(Completion())
            target = self.alternatives[d.index - 1]
            target.add(dataclasses.replace(d, index=0, usage=None))
            if d.usage is not None:
                self.usage = d.usage
            return
        if d.text or d.audio or d.tool_calls or d.reasoning:
            self.pieces += 1
        if d.text:
            self.text += d.text
        if d.tool_calls:
            merge_tool_calls(self.tool_calls, d.tool_calls)
        if d.reasoning:
            self.reasoning += d.reasoning
            self.reasoning_key = d.reasoning_key
        if d.logprobs:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.audio:
            self.audio += d.audio
            self.sample_rate = d.sample_rate or self.sample_rate
            self.channels = d.channels
        if d.transcript:
            self.transcript += d.transcript
        if d.finish_reason:
            self.finish_reason = d.finish_reason
        if d.usage is not None:
            self.usage = d.usage


def merge_tool_calls(calls: list[dict[str, Any]], fragments: list[dict[str, Any]]) -> None:
    """Fold streamed tool-call fragments into whole calls, as OpenAI's SDKs reassemble them (by ``index``)."""
    for frag in fragments:
        index = frag.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if frag.get("id"):
            call["id"] = frag["id"]
        fn = frag.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


def tool_call_text(calls: list[dict[str, Any]]) -> str:
    """Tool calls as one canonical text (name and arguments of each): what digests and counts read."""
    return "\n".join(
        f"{(c.get('function') or {}).get('name', '')}({(c.get('function') or {}).get('arguments', '')})"
        for c in calls
    )
