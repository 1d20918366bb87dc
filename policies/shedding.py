"""Built-in pre-policy ``load-shedding``: above the soft limit, speech is the first thing to go.

Qwen3-Omni's time to first audio packet grows five-fold from one to two concurrent streams on vLLM-Omni,
while text barely moves; so a request admitted above its class's soft limit (see
:mod:`gateway.admission`) that asked for speech is served text-only instead of being refused:
``modalities: ["text"]`` upstream, ``x-omnigate-degraded: load-text-only`` to the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from core.context import DEGRADED_TEXT_ONLY, RequestContext
from core.schemas import ChatCompletionRequest
from policies.base import PolicyBase, PolicyConfig

if TYPE_CHECKING:
    from core.context import LoadSnapshot

Action = Literal["as-asked", "text-only"]


class LoadSheddingConfig(PolicyConfig):
    """No knobs: the limits are the admission's (``traffic.soft_limit`` and the priority classes)."""


def decide(load: LoadSnapshot | None, wants_speech: bool) -> Action:
    """Text-only when speech was asked for and the request was admitted above its soft limit."""
    if wants_speech and load is not None and load.above_soft_limit:
        return "text-only"
    return "as-asked"


class LoadShedding(PolicyBase):
    name: ClassVar[str] = "load-shedding"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = LoadSheddingConfig
    #: a :class:`policies.base.LoadShedder`
    sheds_load: ClassVar[bool] = True

    def __init__(self, config: LoadSheddingConfig) -> None:
        self.config = config

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        if decide(ctx.load, request.wants_audio) == "text-only":
            ctx.outputs.degrade(DEGRADED_TEXT_ONLY)
            ctx.outputs.control["shedding"] = {"action": "text-only", "reason": DEGRADED_TEXT_ONLY}
            return request.model_copy(update={"modalities": ["text"], "audio": None})
        return request
