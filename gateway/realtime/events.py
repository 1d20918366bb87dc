"""The client events of OpenAI's Realtime protocol (GA names) the gateway accepts, as pydantic models
discriminated on ``type``, and the shape of the ``error`` event it answers a bad one with.

Only what a session over a chat engine can honour is modelled. OpenAI's session object has more fields
(tools, tracing, transcription, noise reduction, ...): they are accepted and ignored, so an official client
that sends its defaults keeps working; a value the gateway cannot serve (another audio format, semantic VAD)
is refused by name.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from core.errors import ClientClosedRequest

#: the sample rates a session's PCM16 may use (OpenAI's is 24 kHz only; 16 kHz for telephony-style clients)
RATES = (8000, 16000, 24000, 48000)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    # OpenAI's session objects carry more than a chat engine can use; an official client sends them.
    model_config = ConfigDict(extra="ignore")


class AudioFormat(_Lenient):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int = 24000


class ServerVad(_Lenient):
    type: Literal["server_vad"]
    threshold: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    prefix_padding_ms: Annotated[int, Field(ge=0, le=2000)] | None = None
    silence_duration_ms: Annotated[int, Field(ge=100, le=5000)] | None = None
    create_response: bool = True
    interrupt_response: bool = True


class AudioInput(_Lenient):
    format: AudioFormat | None = None
    #: ``None`` is meaningful (manual commit): the field being absent is not the same as null
    turn_detection: ServerVad | None = Field(default=None)


class AudioOutput(_Lenient):
    format: AudioFormat | None = None
    voice: Annotated[str, Field(min_length=1, max_length=64)] | None = None


class AudioConfig(_Lenient):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class SessionConfig(_Lenient):
    type: Literal["realtime"] = "realtime"
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    instructions: Annotated[str, Field(max_length=64_000)] | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | Literal["inf"] | None = None


class Part(_Lenient):
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text", "audio"]
    text: Annotated[str, Field(max_length=64_000)] | None = None
    audio: str | None = None
    transcript: Annotated[str, Field(max_length=64_000)] | None = None


class Item(_Lenient):
    type: Literal["message"] = "message"
    id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Part], Field(max_length=16)]


class ResponseParams(_Lenient):
    instructions: Annotated[str, Field(max_length=64_000)] | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | Literal["inf"] | None = None


class _Client(_Strict):
    event_id: Annotated[str, Field(max_length=128)] | None = None


class SessionUpdate(_Client):
    type: Literal["session.update"]
    session: SessionConfig


class BufferAppend(_Client):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Client):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Client):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Client):
    type: Literal["conversation.item.create"]
    item: Item
    previous_item_id: str | None = None


class ItemDelete(_Client):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_Client):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemTruncate(_Client):
    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: Annotated[int, Field(ge=0)] = 0
    audio_end_ms: Annotated[int, Field(ge=0)]


class ResponseCreate(_Client):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Client):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Annotated[
    SessionUpdate
    | BufferAppend
    | BufferCommit
    | BufferClear
    | ItemCreate
    | ItemDelete
    | ItemRetrieve
    | ItemTruncate
    | ResponseCreate
    | ResponseCancel,
    Field(discriminator="type"),
]
CLIENT_EVENT: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
#: the ``type`` of every event modelled here
KNOWN: frozenset[str] = frozenset(
    get_args(m.model_fields["type"].annotation)[0] for m in get_args(get_args(ClientEvent)[0])
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ClientGone(ClientClosedRequest):
    """The client stopped reading (a write missed its deadline) or its socket is closed: a turn in progress
    is accounted for as a client that left."""

    def __init__(self, message: str = "the realtime client is gone") -> None:
        super().__init__(message)


class RealtimeError(Exception):
    """A client mistake the session answers with an ``error`` event (and stays open, unless ``fatal``)."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.type, self.fatal = message, code, param, type_, fatal

    def event(self, event_id: str | None) -> dict[str, Any]:
        """The Realtime ``error`` event: its own id, and the id of the client event that caused it."""
        return {
            "type": "error",
            "event_id": new_id("event"),
            "error": {
                "type": self.type,
                "code": self.code,
                "message": self.message,
                "param": self.param,
                "event_id": event_id,
            },
        }


def bad(message: str, code: str, param: str | None = None, *, fatal: bool = False) -> RealtimeError:
    """A client's ``invalid_request_error``."""
    return RealtimeError(message, code=code, param=param, fatal=fatal)
