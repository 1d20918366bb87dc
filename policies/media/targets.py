"""What the engines behind each public model take, for the media steps (no codec libraries here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequest
from core.schemas import ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class MediaTarget:
    """What the engines behind one public model take."""

    video_form: str = "video"  # video | frames
    audio_rate: int | None = 16000
    context_tokens: int = 65536
    #: the input modalities of each engine serving the model (empty: not known, not checked)
    accepts: tuple[frozenset[str], ...] = ()


def targets_from(engines: list[Any]) -> dict[str, MediaTarget]:
    """One target per public model: the most conservative of the engines serving it."""
    by_model: dict[str, list[Any]] = {}
    for e in engines:
        for public in e.serves:
            by_model.setdefault(public, []).append(e)
    out: dict[str, MediaTarget] = {}
    order = {"primary": 0, "canary": 1, "fallback": 2}
    for model, cfgs in by_model.items():
        cfgs = sorted(cfgs, key=lambda c: order[c.role])
        video = "video" if all(c.video_form() == "video" for c in cfgs) else "frames"
        rates = [c.audio_rate() for c in cfgs if c.audio_rate() is not None]
        accepts = tuple(c.modalities()[0] for c in cfgs)
        out[model] = MediaTarget(
            video, rates[0] if rates else None, min(c.max_context_tokens for c in cfgs), accepts
        )
    return out


def check_modalities(request: ChatCompletionRequest, target: MediaTarget | None) -> None:
    """Refuse input no engine of the model takes, before any media is fetched or decoded."""
    if target is None or not target.accepts:
        return
    wanted = request.input_modalities()
    if not any(wanted <= accepts for accepts in target.accepts):
        kinds = ", ".join(sorted(wanted - {"text"}))
        raise InvalidRequest(f"the model {request.model!r} does not accept {kinds} input", param="messages")
