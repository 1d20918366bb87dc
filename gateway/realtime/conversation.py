"""A realtime session's configuration and conversation: what ``session.update`` sets and the items the
turns are answered from (bounded: the oldest leave the context past ``realtime.max_items``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.realtime import events as ev
from gateway.realtime.vad import VadParams


@dataclass(slots=True)
class SessionConfig:
    model: str
    instructions: str | None = None
    modalities: list[str] = field(default_factory=lambda: ["audio"])
    voice: str | None = None
    in_rate: int = 24000
    out_rate: int = 24000
    vad: VadParams | None = None
    create_response: bool = True
    interrupt_response: bool = True
    max_output_tokens: int | None = None

    def wire(self, session_id: str) -> dict[str, Any]:
        """The GA session object (``session.created`` and ``session.updated``)."""
        detection: dict[str, Any] | None = None
        if self.vad is not None:
            detection = {
                "type": "server_vad",
                "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response,
            }
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "instructions": self.instructions or "",
            "output_modalities": list(self.modalities),
            "max_output_tokens": self.max_output_tokens or "inf",
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": self.in_rate}, "turn_detection": detection},
                "output": {"format": {"type": "audio/pcm", "rate": self.out_rate}, "voice": self.voice},
            },
            "tools": [],
            "tool_choice": "auto",
        }


@dataclass(slots=True)
class Item:
    id: str
    role: str
    text: str = ""
    #: user audio: PCM16 at the session's input rate
    audio: bytes = b""
    #: assistant audio sent, in ms (what a truncation cuts)
    audio_ms: int = 0
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.role == "assistant":
            content.append(
                {"type": "output_audio", "transcript": self.text}
                if self.audio_ms
                else {"type": "output_text", "text": self.text}
            )
        elif self.role == "system":
            content.append({"type": "input_text", "text": self.text})
        else:
            if self.audio:
                content.append({"type": "input_audio", "transcript": None})
            if self.text:
                content.append({"type": "input_text", "text": self.text})
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": content,
        }


@dataclass(slots=True)
class Conversation:
    limit: int
    items: list[Item] = field(default_factory=list)

    def find(self, item_id: str) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def add(self, item: Item, after: str | None = None) -> str | None:
        """Insert ``item`` (after ``after``, "root" for first, None for last); returns the id before it."""
        if after is None:
            self.items.append(item)
        elif after == "root":
            self.items.insert(0, item)
        else:
            prev = self.find(after)
            if prev is None:
                raise ev.bad(f"no item {after!r} in the conversation", "item_not_found", "previous_item_id")
            self.items.insert(self.items.index(prev) + 1, item)
        del self.items[: max(0, len(self.items) - self.limit)]  # the oldest leave the context
        at = self.items.index(item) if item in self.items else 0
        return self.items[at - 1].id if at > 0 else None
