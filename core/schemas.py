"""Typed wire models for OpenAI chat completions as clients send them.

Only the fields listed here ever reach an engine: the allow-list is OpenAI's
chat-completions request as vLLM accepts it (tools, structured output, logprobs,
penalties, ...) plus vLLM's sampling extras. Every model forbids unknown fields,
so one can never be carried along unnoticed: :mod:`gateway.fields` refuses the
request naming it, or (``unknown_fields: drop``) drops it and says so. There is
no field through which a client could set an engine's URL, key or headers, and
``chat_template_kwargs`` takes only the keys in :data:`CHAT_TEMPLATE_KWARGS`.

The allow-list is the request model here with the message of :mod:`core.message`, the leaf models of
:mod:`core.request_parts` (parts, tools, formats) and the tables and bounds of :mod:`core.request_fields`;
a reviewer reads the four to see what can reach an engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.errors import InvalidRequest
from core.message import Message
from core.request_fields import (
    _INT32,
    CHAT_TEMPLATE_KWARGS,
    FEATURE_FIELDS,
    GUIDED_FIELDS,
    UNSUPPORTED_FIELDS,
    VLLM_EXTRA_FIELDS,
    LogitBias,
    Metadata,
    StopTokenIds,
    StructuredOutputs,
    _Choices,
    _Constraint,
)
from core.request_parts import (
    MAX_TOOL_CALLS,
    PART_MODALITY,
    AudioRequest,
    AudioURLPart,
    ImagePart,
    InputAudio,
    InputAudioPart,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    TextPart,
    Tool,
    URLRef,
    VideoURLPart,
)

# Re-exported: the moved models and tables are imported from here (gateway, engines, policies, tests).
__all__ = ["MAX_JSON_DEPTH", "ChatCompletionRequest", "Message", "too_deep"]
__all__ += ["FEATURE_FIELDS", "MAX_TOOL_CALLS", "PART_MODALITY", "VLLM_EXTRA_FIELDS", "AudioURLPart"]
__all__ += ["ImagePart", "InputAudio", "InputAudioPart", "TextPart", "URLRef", "VideoURLPart"]

#: how deep a request body may nest objects and arrays, the body itself being level 1 (docs/clients.md)
MAX_JSON_DEPTH = 64
#: path components a depth error names (the field, and where in it)
_DEPTH_PATH = 4


def too_deep(doc: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Where ``doc`` (level 1) first nests an object or array past ``limit`` levels; None if it does not.

    A stack, not recursion: it exists to refuse what recursive code (pydantic's serialiser, orjson's
    writer, a canonicaliser) could not read. The path names the field and at most
    ``_DEPTH_PATH`` steps of it (``tools.0.function.parameters``); each step is cut to 64 characters.
    """
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(doc, 1, ())]
    while stack:
        value, level, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if not isinstance(item, (dict, list)):
                continue
            step = (*path, str(key)[:64]) if len(path) < _DEPTH_PATH else path
            if level >= limit:
                return ".".join(step)
            stack.append((item, level + 1, step))
    return None


class ChatCompletionRequest(BaseModel):
    """A chat completion request as the gateway accepts it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    n: Annotated[int, Field(ge=1, le=8)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM extras, allow-listed
    top_k: Annotated[int, Field(ge=-1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    chat_template_kwargs: dict[str, bool] | None = None
    #: vLLM's cap on reasoning tokens (sent only to an engine that enforces it: engines/adapters/base.Capabilities)
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    # vLLM's sampling and decoding extras (VLLM_EXTRA_FIELDS), each only to an engine that takes it
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_INT32)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | _Constraint | None = None
    guided_regex: _Constraint | None = None
    guided_choice: _Choices | None = None
    guided_grammar: _Constraint | None = None
    #: vLLM's scheduling priority (lower runs earlier, 0 by default): only 0 or more, so a client can yield
    #: its place to other requests but never take theirs
    priority: Annotated[int, Field(ge=0, le=_INT32)] | None = None
    # OpenAI's own fields the gateway honours in its way (docs/clients.md)
    #: up to 16 string pairs the client attaches; recorded in the audit record
    metadata: Metadata | None = None
    #: a stable identifier of the client's end user (what ``user`` was); recorded in the audit record
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    #: only ``false``: the gateway keeps no completions to retrieve later (``true`` is refused)
    store: bool | None = None
    #: accepted; every request is served at the one tier the gateway's engines run
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    #: accepted; not yet used (no engine affinity for prompt caches)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nesting_bounded(cls, data: Any) -> Any:
        # Before any field is read: a schema nested hundreds of levels passes pydantic and then breaks the
        # serialisers on the way to the engine. The error tree's own 400, not a ValueError: pydantic would
        # locate that at the root, and the client is told which field.
        path = too_deep(data) if isinstance(data, (dict, list)) else None
        if path is not None:
            raise InvalidRequest(
                f"{path}: the request nests objects and arrays deeper than {MAX_JSON_DEPTH} levels "
                f"(the body itself is level 1); flatten it",
                param=path,
            )
        if isinstance(data, dict):
            # Known fields the gateway cannot honour: said so (unknown_fields: drop would lose them unsaid).
            for name, why in UNSUPPORTED_FIELDS.items():
                if name in data:
                    raise InvalidRequest(f"{name}: {why}", param=name, code="unsupported_field")
            if data.get("store") is True:
                raise InvalidRequest(
                    "store: true is not supported; this gateway keeps no completions to retrieve later "
                    "(send store: false or leave it out)",
                    param="store",
                    code="unsupported_field",
                )
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_allowed(cls, v: dict[str, bool] | None) -> dict[str, bool] | None:
        for key in v or {}:
            if key not in CHAT_TEMPLATE_KWARGS:
                raise ValueError(
                    f"the key {key!r} is not accepted; allowed: {', '.join(sorted(CHAT_TEMPLATE_KWARGS))}"
                )
        return v

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError("tool_choice names a function that is not in tools")
        if self.tool_choice in ("required",) and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 8:
            raise ValueError("at most 8 stop sequences")
        return v

    @model_validator(mode="after")
    def _extras_consistent(self) -> ChatCompletionRequest:
        guided = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if len(guided) + (self.structured_outputs is not None) > 1:
            raise ValueError(
                "send one structured-output constraint: structured_outputs or one guided_* field"
            )
        if (guided or self.structured_outputs is not None) and (
            self.response_format is not None and self.response_format.type != "text"
        ):
            raise ValueError(
                "response_format and a structured-output constraint exclude each other; send one"
            )
        limit = self.output_token_limit
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise ValueError("min_tokens must not be more than max_tokens")
        return self

    @model_validator(mode="after")
    def _audio_needs_format(self) -> ChatCompletionRequest:
        if self.modalities and "audio" in self.modalities and self.audio is None:
            object.__setattr__(self, "audio", AudioRequest())
        return self

    def features(self) -> set[str]:
        """The fields of :data:`FEATURE_FIELDS` this request sets (an engine must honour each or refuse)."""
        found = {f for f in (*FEATURE_FIELDS, *VLLM_EXTRA_FIELDS) if getattr(self, f) is not None}
        if self.choices > 1:
            found.add("n")
        return found

    def structured(self) -> dict[str, Any] | None:
        """The structured-output constraint as vLLM's ``structured_outputs`` takes it (``guided_*`` moved
        there: vLLM has removed them), or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        for name, key in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                return {key: value}
        return None

    @property
    def choices(self) -> int:
        """How many answers the client asked for (``n``)."""
        return self.n or 1

    @property
    def wants_audio(self) -> bool:
        return bool(self.modalities and "audio" in self.modalities)

    @property
    def thinking_off(self) -> bool:
        """The client turned the model's thinking off through its chat template switch."""
        kw = self.chat_template_kwargs or {}
        return any(kw.get(k) is False for k in CHAT_TEMPLATE_KWARGS)

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


# -- the audio endpoints' requests (gateway/api/audio.py): each is served as the chat completion it stands for

#: the longest text ``/v1/audio/speech`` reads aloud, in characters (OpenAI's own limit)
MAX_SPEECH_INPUT = 4096
#: what ``/v1/audio/speech`` can answer in (``aac`` through PyAV, the rest as chat's spoken answers are encoded)
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech`` as OpenAI defines it: text to read aloud, in a voice and a format."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    input: Annotated[str, Field(min_length=1, max_length=MAX_SPEECH_INPUT)]
    voice: Annotated[str, Field(min_length=1, max_length=64)]
    #: OpenAI's default
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: Annotated[float, Field(ge=0.25, le=4.0)] = 1.0
    #: how to read it (tone, pace); given to the model beside the text, never read aloud
    instructions: Annotated[str, Field(max_length=MAX_SPEECH_INPUT)] | None = None
    #: ``audio`` only: the whole file is the answer (``sse`` is refused with a 400 naming the field)
    stream_format: Literal["audio", "sse"] | None = None


class TranscriptionRequest(BaseModel):
    """The form fields of ``POST /v1/audio/transcriptions`` but the file (OpenAI's names and bounds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[str, Field(min_length=1, max_length=256)]
    #: the audio's language, ISO-639-1 (``en``) or a BCP 47 tag; a hint to the model
    language: Annotated[str, Field(pattern=r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8}){0,2}$")] | None = None
    #: words or a style the transcript should follow (names, spelling); a hint, screened like any text
    prompt: Annotated[str, Field(max_length=MAX_SPEECH_INPUT)] | None = None
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    #: only ``false``: the transcript is one answer
    stream: bool | None = None
