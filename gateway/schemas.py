"""Typed wire models for OpenAI chat completions as clients send them.

Only the fields listed here ever reach an engine. Unknown top-level fields are
kept aside (``ignored_fields``) so they can be logged, and are never forwarded;
there is no field through which a client could set an engine's URL, key or
headers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

AudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16", "pcm"]


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class URLRef(_Part):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Part):
    data: Annotated[str, Field(min_length=1)]
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
    Union[TextPart, ImagePart, InputAudioPart, AudioURLPart, VideoURLPart],
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


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "Message":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self

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


class AudioRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    voice: Annotated[str, Field(min_length=1, max_length=64)] = "Chelsie"
    format: AudioFormat = "wav"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """A chat completion request as the gateway accepts it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioRequest | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    # vLLM extras, allow-listed
    top_k: Annotated[int, Field(ge=-1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 8:
            raise ValueError("at most 8 stop sequences")
        return v

    @model_validator(mode="after")
    def _audio_needs_format(self) -> "ChatCompletionRequest":
        if self.modalities and "audio" in self.modalities and self.audio is None:
            object.__setattr__(self, "audio", AudioRequest())
        return self

    @property
    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    @property
    def wants_audio(self) -> bool:
        return bool(self.modalities and "audio" in self.modalities)

    @property
    def output_token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def input_modalities(self) -> set[str]:
        found: set[str] = set()
        for m in self.messages:
            for p in m.parts():
                found.add(PART_MODALITY[p.type])
        return found
