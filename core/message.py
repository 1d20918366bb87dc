"""One message of a chat request as clients send it: its role, its content (text or parts), the tool calls
of an assistant turn or the call a tool turn answers, and the fields the SDKs echo back on an assistant turn
(accepted, never forwarded).

:mod:`core.schemas` re-exports it and holds the request, a list of these; its parts and tool calls are
:mod:`core.request_parts`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from core.request_parts import (
    ASSISTANT_ECHOES,
    MAX_TOOL_CALLS,
    AssistantAudio,
    ContentPart,
    TextPart,
    ToolCall,
    _Wire,
)


class Message(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    #: assistant turns: the calls it made; tool turns: the call answered
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Assistant turns as the SDKs echo an answer (ASSISTANT_ECHOES): accepted, never forwarded.
    audio: AssistantAudio | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=1024)] | None = None
    #: the legacy single function call: only the ``null`` the SDKs echo (``functions`` are not served)
    function_call: Any = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only for assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool messages need the tool_call_id they answer")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id is only for tool messages")
        if self.function_call is not None:
            raise ValueError("function_call (legacy functions) is not served; send tool_calls")
        if self.role != "assistant":
            for key in ("audio", "reasoning_content", "reasoning", "refusal", "annotations"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} is only for assistant messages")
        return self

    def wire(self) -> dict[str, Any]:
        """The message as an engine receives it (known fields only, by construction; no echoes)."""
        return self.model_dump(exclude_none=True, exclude=set(ASSISTANT_ECHOES))

    def text(self) -> str:
        """The message's text, parts joined with newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def parts(self) -> list[Any]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)
