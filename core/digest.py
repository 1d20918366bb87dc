"""What a stream released, as digests: fed once per released delta, read by the audit record.

SHA-256 of the output released to the client: its text, its 16-bit PCM audio, its spoken transcript,
its tool calls (each call's name and arguments, in the order released) and its reasoning text. The
pipeline feeds it on the request path; observability/audit/record.py encodes it off it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from core.events import Completion, Delta


class OutputDigest:
    """A running digest of what a stream released; fed once per released delta (a few microseconds)."""

    __slots__ = (
        "_audio",
        "_reasoning",
        "_text",
        "_tools",
        "_transcript",
        "audio_bytes",
        "keep",
        "kept",
        "reasoning_chars",
        "text_chars",
        "tool_call_chars",
    )

    def __init__(self, keep_text: bool = False) -> None:
        self._text = hashlib.sha256()
        self._audio = hashlib.sha256()
        self._transcript = hashlib.sha256()
        self._tools = hashlib.sha256()
        self._reasoning = hashlib.sha256()
        self.text_chars = 0
        self.tool_call_chars = 0
        self.reasoning_chars = 0
        self.audio_bytes = 0
        self.keep = keep_text
        self.kept: list[str] = []

    def add(self, d: Delta) -> None:
        if d.text:
            self._text.update(d.text.encode())
            self.text_chars += len(d.text)
            if self.keep:
                self.kept.append(d.text)
        if d.audio:
            self._audio.update(d.audio)
            self.audio_bytes += len(d.audio)
        if d.transcript:
            self._transcript.update(d.transcript.encode())
        if d.tool_calls:
            # Streamed and whole calls digest alike: only names and argument text, in order.
            for call in d.tool_calls:
                fn = call.get("function") or {}
                piece = (fn.get("name") or "") + (fn.get("arguments") or "")
                if piece:
                    self._tools.update(piece.encode())
                    self.tool_call_chars += len(piece)
        if d.reasoning:
            self._reasoning.update(d.reasoning.encode())
            self.reasoning_chars += len(d.reasoning)

    @classmethod
    def of(cls, completion: Completion, keep_text: bool = False) -> OutputDigest:
        out = cls(keep_text)
        for c in (completion, *completion.alternatives):  # every choice of n > 1 was released
            out.add(
                Delta(
                    text=c.text,
                    audio=c.audio,
                    transcript=c.transcript,
                    tool_calls=c.tool_calls or None,
                    reasoning=c.reasoning,
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text_sha256": self._text.hexdigest(),
            "text_chars": self.text_chars,
            "audio_sha256": self._audio.hexdigest(),
            "audio_bytes": self.audio_bytes,
            "transcript_sha256": self._transcript.hexdigest(),
        }
        # Present only when the answer had them, so records of plain answers keep their shape.
        if self.tool_call_chars:
            out["tool_calls_sha256"] = self._tools.hexdigest()
            out["tool_call_chars"] = self.tool_call_chars
        if self.reasoning_chars:
            out["reasoning_sha256"] = self._reasoning.hexdigest()
            out["reasoning_chars"] = self.reasoning_chars
        return out

    def text(self) -> str:
        return "".join(self.kept)
