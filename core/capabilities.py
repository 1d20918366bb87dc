"""What an engine takes and does, as its adapter declares it: the facts the rest of the gateway reads.

An adapter fills :class:`Capabilities` from its configuration (``engines/adapters/base.py``'s
:func:`~engines.adapters.base.declared`) and the gateway hands the media policies each engine's
:class:`EngineFacts` (``policies/base.py``'s ``Deps.engines``): the policies read what the engine
takes (its modalities, its video form and audio rate, its context) from the adapter, never from the
settings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    input_modalities: frozenset[str] = frozenset({"text"})
    output_modalities: frozenset[str] = frozenset({"text"})
    #: request fields of core.schemas.FEATURE_FIELDS the engine honours; a request setting any other
    #: is not sent to it (refused when no engine for the model honours it)
    features: frozenset[str] = frozenset()
    #: the engine enforces a reasoning-token budget itself (vLLM's ``thinking_token_budget``); without
    #: it only ``max_tokens`` bounds thinking (engines/selection/thinking.py)
    thinking_budget: bool = False
    #: how the engine takes video: ``video`` (a container) or ``frames`` (a sequence of images)
    video_form: str = "video"
    #: the sample rate the engine's audio encoder works at (None: any, sent as it is)
    audio_rate: int | None = 16000
    #: the engine's context window in tokens (prompt, media and output together)
    context_tokens: int = 65536

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """One engine as the policies see it: its name, the public models it serves, its role, what it takes."""

    name: str
    serves: tuple[str, ...]
    role: str
    capabilities: Capabilities
