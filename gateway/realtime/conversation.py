"""A realtime session's configuration and conversation: what ``session.update`` sets and the items the
turns are answered from (bounded: the oldest leave the context past ``realtime.max_items``)."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gateway.realtime import events as ev
from gateway.realtime.audio import resampled
from gateway.realtime_settings import VadDefaults, VadParams


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

    def update(self, s: ev.SessionConfig, defaults: VadDefaults) -> bool:
        """Apply a ``session.update`` whole or not at all (what it leaves out stays); True when turn detection
        changed."""
        cfg = replace(self)  # a refused value leaves the session as it was
        detection = False
        if s.model is not None:
            cfg.model = s.model  # the tenant's access to it is checked on every turn, as for chat
        if "instructions" in s.model_fields_set:
            cfg.instructions = s.instructions
        if s.output_modalities:
            if len(set(s.output_modalities)) != 1:
                raise ev.bad(
                    "output_modalities is ['audio'] or ['text']",
                    "invalid_value",
                    "session.output_modalities",
                )
            cfg.modalities = list(s.output_modalities)
        if s.max_output_tokens is not None:
            cfg.max_output_tokens = None if s.max_output_tokens == "inf" else s.max_output_tokens
        audio = s.audio
        if audio is not None and audio.input is not None:
            if audio.input.format is not None:
                cfg.in_rate = _rate(audio.input.format.rate, "session.audio.input.format.rate")
            if "turn_detection" in audio.input.model_fields_set:
                cfg.vad, detection = _detection(audio.input.turn_detection, defaults, cfg), True
        if audio is not None and audio.output is not None:
            if audio.output.format is not None:
                cfg.out_rate = _rate(audio.output.format.rate, "session.audio.output.format.rate")
            if audio.output.voice is not None:
                cfg.voice = audio.output.voice
        for f in fields(self):
            setattr(self, f.name, getattr(cfg, f.name))
        return detection


@dataclass(slots=True)
class Item:
    id: str
    role: str
    text: str = ""
    #: user audio: PCM16 at ``rate`` (the session's input rate when it was committed)
    audio: bytes = b""
    rate: int = 24000
    #: assistant audio sent, in ms (what a truncation cuts)
    audio_ms: int = 0
    status: str = "completed"
    #: ``audio`` at the engine's rate, made once (:meth:`Conversation.resample`): every later turn sends it again
    resampled: tuple[int, bytes] | None = None

    def audio_at(self, rate: int | None) -> tuple[bytes, int]:
        """The item's audio (PCM16) and its rate: at ``rate`` where it was resampled to it, else as committed
        (the media steps resample it then)."""
        if rate is not None and self.resampled is not None and self.resampled[0] == rate:
            return self.resampled[1], rate
        return self.audio, self.rate

    def wire(self, with_audio: bool = False) -> dict[str, Any]:
        """The item as the events show it; ``with_audio``: a user item's audio too, base64 PCM16 (retrieve)."""
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
                part: dict[str, Any] = {"type": "input_audio", "transcript": None}
                if with_audio:
                    part["audio"] = base64.b64encode(self.audio).decode("ascii")
                content.append(part)
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

    def item_from(self, it: ev.Item, rate: int) -> Item:
        """A client's ``conversation.item.create`` item (its input audio PCM16 at the session's rate)."""
        if it.id is not None and self.find(it.id) is not None:
            raise ev.bad(f"an item {it.id!r} exists already", "invalid_value", "item.id")
        item = Item(it.id or ev.new_id("item"), it.role, rate=rate)
        for part in it.content:
            if part.type == "input_audio" and part.audio:
                if it.role != "user":
                    raise ev.bad("only user items carry input audio", "invalid_value", "item.content")
                try:
                    item.audio += base64.b64decode(part.audio, validate=True)
                except (binascii.Error, ValueError):
                    raise ev.bad("audio is not valid base64", "invalid_value", "item.content.audio") from None
            else:
                item.text += part.text or part.transcript or ""
        return item

    async def resample(self, rate: int | None) -> None:
        """Resample, off the event loop, the user audio not yet at ``rate`` (the engine's): once per item, so a
        turn costs the media steps a header's probe of the earlier turns' audio, not their resampling again."""
        if rate is None:
            return
        for item in self.items:
            if not item.audio or item.rate == rate or (item.resampled and item.resampled[0] == rate):
                continue
            audio = item.audio
            pcm = await asyncio.to_thread(resampled, audio, item.rate, rate)
            if item.audio is audio:  # not let go of meanwhile
                item.resampled = (rate, pcm)

    def forget_audio(self, keep_s: float) -> None:
        """Let go of user audio older than the newest ``keep_s`` seconds: no turn sends it again (the context
        carries the newest audio only), so a long session holds no more than that of it."""
        kept = False
        for at, item in reversed(list(enumerate(self.items))):
            took = len(item.audio) / (2 * item.rate)
            if took and (took <= keep_s or not kept):  # the newest turn's audio is always kept
                keep_s, kept = keep_s - took, True
            elif took:
                for old in self.items[: at + 1]:
                    old.audio, old.resampled = b"", None
                return

    def truncate(self, item_id: str, audio_end_ms: int) -> Item:
        """Cut an assistant item where its audio stopped being played: what was not heard leaves the context,
        its transcript cut at the same share (at a word's end)."""
        item = self.find(item_id)
        if item is None or item.role != "assistant":
            raise ev.bad(f"no assistant item {item_id!r} in the conversation", "item_not_found", "item_id")
        if audio_end_ms > item.audio_ms:
            raise ev.bad(
                f"audio_end_ms {audio_end_ms} is past the item's audio ({item.audio_ms} ms)",
                "invalid_value",
                "audio_end_ms",
            )
        keep = int(len(item.text) * audio_end_ms / item.audio_ms) if item.audio_ms else 0
        cut = item.text[:keep]
        if keep < len(item.text) and " " in cut:
            cut = cut[: cut.rfind(" ")]
        item.text, item.audio_ms, item.status = cut, audio_end_ms, "incomplete"
        return item


def _detection(td: ev.ServerVad | None, d: VadDefaults, cfg: SessionConfig) -> VadParams | None:
    """Server VAD's parameters (None: manual commit); refused by name where the model is not installed."""
    if td is None:
        return None
    try:
        from gateway.realtime.vad import shared_model

        shared_model()  # present, loadable: refused here rather than at the first append
    except (FileNotFoundError, ImportError) as exc:
        raise ev.bad(
            f"server_vad is not available on this gateway ({exc}); commit turns yourself "
            "(turn_detection: null)",
            "server_vad_unavailable",
            "session.audio.input.turn_detection",
        ) from None
    params = VadParams(
        td.threshold if td.threshold is not None else d.threshold,
        td.prefix_padding_ms if td.prefix_padding_ms is not None else d.prefix_padding_ms,
        td.silence_duration_ms if td.silence_duration_ms is not None else d.silence_duration_ms,
    )
    cfg.create_response, cfg.interrupt_response = td.create_response, td.interrupt_response
    return params


def _rate(rate: int, param: str) -> int:
    if rate not in ev.RATES:
        raise ev.bad(
            f"audio/pcm at {rate} Hz is not served; use one of {list(ev.RATES)}",
            "invalid_value",
            param,
        )
    return rate
