"""The request's leaf wire models: content parts, tool calls, tools, audio and response formats.

Split from :mod:`core.schemas`, which re-exports every name here: the allow-list of what can reach an
engine is these models together with the message in :mod:`core.message` and the request in
:mod:`core.schemas`. The models here declare fields only (pydantic checks them without calling back into
this module), save the few validators of fields an ordinary text request does not send.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from core.spooled import SpooledMedia

AudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16", "pcm"]


class _Wire(BaseModel):
    # Unknown fields are refused or dropped visibly (gateway/fields.py), never carried silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Part(_Wire):
    """A content part (a class, not an alias of _Wire: pydantic's mypy plugin reads no alias as a base)."""


class URLRef(_Part):
    # A long data URI is read into the spool as the body arrives (core/spooled.py): the part then
    # carries it as a SpooledMedia, never a client's choice (JSON cannot make one).
    url: Annotated[str, Field(min_length=1)] | SkipJsonSchema[SpooledMedia]
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Part):
    data: Annotated[str, Field(min_length=1)] | SkipJsonSchema[SpooledMedia]
    format: str = "wav"


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: URLRef


class InputAudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(_Part):
    type: Literal["audio_url"]
    audio_url: URLRef


class VideoURLPart(_Part):
    type: Literal["video_url"]
    video_url: URLRef


ContentPart = Annotated[
    TextPart | ImagePart | InputAudioPart | AudioURLPart | VideoURLPart,
    Field(discriminator="type"),
]

#: content-part type -> the input modality it carries
PART_MODALITY: dict[str, str] = {
    "text": "text",
    "image_url": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
}


class FunctionCall(_Wire):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=1_000_000)]


class ToolCall(_Wire):
    """A call the assistant made, as a client sends it back in the conversation."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


#: the most tool calls one assistant message carries (and so one answer: a client sends them back in one)
MAX_TOOL_CALLS = 128


class AssistantAudio(_Wire):
    """An earlier spoken answer, as a client sends it back in the conversation.

    OpenAI's reference shape is ``{"id": ...}``; the SDKs echo the whole object they were given
    (``data``, ``expires_at``, ``transcript`` beside the id). Only the id is read: the gateway resolves it
    to the transcript it served (gateway/answer_audio.py). The echoed audio itself is let go of here,
    so a conversation does not carry every answer's speech along to the engine or the audit record.
    """

    id: Annotated[str, Field(min_length=1, max_length=256)]
    expires_at: int | None = None
    transcript: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _audio_let_go(cls, data: Any) -> Any:
        if isinstance(data, dict) and "data" in data:
            data = {k: v for k, v in data.items() if k != "data"}
        return data


#: what an assistant message may carry besides its content because the SDKs echo an answer whole; never
#: sent to an engine (the answer's words are its content, a spoken answer's its transcript)
ASSISTANT_ECHOES: frozenset[str] = frozenset(
    {"audio", "reasoning_content", "reasoning", "refusal", "annotations", "function_call"}
)


class AudioRequest(_Wire):
    voice: Annotated[str, Field(min_length=1, max_length=64)] = "Chelsie"
    format: AudioFormat = "wav"


class StreamOptions(_Wire):
    include_usage: bool = False
    # Accepted as OpenAI defines it; the gateway always asks its engines for usage itself.
    continuous_usage_stats: bool | None = None


_TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(_Wire):
    name: Annotated[str, Field(pattern=_TOOL_NAME)]
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class _NamedFunction(_Wire):
    name: Annotated[str, Field(pattern=_TOOL_NAME)]


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: _NamedFunction


class JSONSchemaFormat(_Wire):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; the wire name is kept through the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("json_schema is only for type 'json_schema'")
        return self
