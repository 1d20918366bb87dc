"""What the engines behind each public model take, for the media steps (no codec libraries here)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from core.capabilities import EngineFacts
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


def targets_from(engines: Iterable[EngineFacts]) -> dict[str, MediaTarget]:
    """One target per public model: the most conservative of the engines serving it, from what each
    engine's adapter declares (``Deps.engines``)."""
    by_model: dict[str, list[EngineFacts]] = {}
    for e in engines:
        for public in e.serves:
            by_model.setdefault(public, []).append(e)
    out: dict[str, MediaTarget] = {}
    order = {"primary": 0, "canary": 1, "fallback": 2}
    for model, facts in by_model.items():
        facts = sorted(facts, key=lambda f: order.get(f.role, 3))
        caps = [f.capabilities for f in facts]
        video = "video" if all(c.video_form == "video" for c in caps) else "frames"
        rates = [c.audio_rate for c in caps if c.audio_rate is not None]
        accepts = tuple(c.input_modalities for c in caps)
        out[model] = MediaTarget(
            video, rates[0] if rates else None, min(c.context_tokens for c in caps), accepts
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
