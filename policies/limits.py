"""Built-in pre-policy ``request-limits``: body size, message count, output-token caps, thinking budget."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from core.context import RequestContext
from core.errors import InvalidRequest, PayloadTooLarge
from core.schemas import ChatCompletionRequest
from policies.base import PolicyBase, PolicyConfig


class RequestLimitsConfig(PolicyConfig):
    """Request size and output-token caps."""

    max_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=16 * 1024 * 1024, description="request bodies above this are refused (413)"
    )
    max_messages: Annotated[int, Field(ge=1)] = Field(default=256, description="messages a request may hold")
    max_output_tokens: Annotated[int, Field(ge=1)] = Field(
        default=8192, description="max_tokens cap: a larger request is capped and flagged max-tokens-capped"
    )
    #: the cap when the client asks for speech: the talker speaks every text token, so a long answer is
    #: minutes of audio (and of GPU time) that one request holds
    max_speech_output_tokens: Annotated[int, Field(ge=1)] = Field(
        default=2048,
        description="the cap instead when the request asks for audio out (the talker speaks every text "
        "token)",
    )
    max_content_parts: Annotated[int, Field(ge=1)] = Field(
        default=64, description="content parts a request may hold, over all its messages"
    )


class RequestLimits(PolicyBase):
    """Refuses oversized requests and caps the output budget.

    A request that asks for more output tokens than the cap is served with the
    cap (``x-omnigate-degraded: max-tokens-capped``) rather than refused: the
    client still gets an answer, cut with ``finish_reason: "length"``. The cap is
    ``max_speech_output_tokens`` when the request asks for audio out, else
    ``max_output_tokens``.
    """

    name: ClassVar[str] = "request-limits"
    stage: ClassVar[str] = "pre"
    Config: ClassVar[type[PolicyConfig]] = RequestLimitsConfig

    def __init__(self, config: RequestLimitsConfig) -> None:
        self.config = config

    async def pre(self, request: ChatCompletionRequest, ctx: RequestContext) -> ChatCompletionRequest:
        cfg = self.config
        if ctx.record.body_bytes > cfg.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {ctx.record.body_bytes} bytes; the limit is {cfg.max_body_bytes}"
            )
        if len(request.messages) > cfg.max_messages:
            raise InvalidRequest(
                f"{len(request.messages)} messages; the limit is {cfg.max_messages}", param="messages"
            )
        parts = sum(len(m.content) for m in request.messages if isinstance(m.content, list))
        if parts > cfg.max_content_parts:
            raise InvalidRequest(
                f"{parts} content parts; the limit is {cfg.max_content_parts}", param="messages"
            )
        cap = cfg.max_speech_output_tokens if request.wants_audio else cfg.max_output_tokens
        asked = request.output_token_limit
        if asked is None:
            return request.model_copy(update={"max_tokens": cap, "max_completion_tokens": None})
        if asked > cap:
            ctx.outputs.degrade("max-tokens-capped")
            return request.model_copy(update={"max_tokens": cap, "max_completion_tokens": None})
        return request
