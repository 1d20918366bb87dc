"""The ``realtime`` settings (gateway/realtime): what one ``/v1/realtime`` session may hold and spend, and server VAD's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class VadDefaults(BaseModel):
    """Server VAD's parameters where a client's ``turn_detection`` leaves one out (OpenAI's defaults)."""

    model_config = ConfigDict(extra="forbid")

    threshold: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        0.5, description="speech probability (Silero VAD) from which a window is speech"
    )
    prefix_padding_ms: Annotated[int, Field(ge=0, le=2000)] = Field(
        300, description="audio before the detected start that speech_started's audio_start_ms includes"
    )
    silence_duration_ms: Annotated[int, Field(ge=100, le=5000)] = Field(
        500, description="silence that ends a turn (speech_stopped, then the commit and the response)"
    )


class RealtimeSettings(BaseModel):
    """``/v1/realtime``: limits per session and per key. A session holds one admission slot for its life;
    each response is one chat completion through the pipeline (guards, shedding, audit per turn)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="serve /v1/realtime (off: the route answers 404)")
    max_sessions_per_key: Annotated[int, Field(ge=1)] = Field(
        4,
        description="sessions one API key (or, without auth, one client address) may hold open at once: "
        "across every replica when redis.url is set (gateway/realtime/places.py), per process otherwise",
    )
    max_session_s: Annotated[float, Field(gt=0)] = Field(
        1800.0, description="a session's longest life; it is closed (1008) when it is over"
    )
    idle_s: Annotated[float, Field(gt=0)] = Field(
        300.0,
        description="a session that sends nothing for this long while no answer is playing gets an error and "
        "is closed (1008): an idle client does not keep its admission slot",
    )
    max_turns: Annotated[int, Field(ge=1)] = Field(200, description="responses one session may create")
    max_audio_s: Annotated[float, Field(gt=0)] = Field(
        900.0, description="seconds of input audio one session may send in all"
    )
    max_turn_audio_s: Annotated[float, Field(gt=0)] = Field(
        60.0, description="seconds of input audio the buffer may hold before a commit (a turn's length)"
    )
    burst_s: Annotated[float, Field(ge=0)] = Field(
        10.0,
        description="seconds of audio a client may send ahead of real time (an upload of a recorded "
        "utterance); beyond it the session gets an error and is closed",
    )
    max_frame_bytes: Annotated[int, Field(ge=1024)] = Field(
        4 * 1024 * 1024, description="the largest client frame taken; a larger one is an error"
    )
    max_errors: Annotated[int, Field(ge=1)] = Field(
        16,
        description="client errors (malformed, unknown or refused events) before the session is closed (1008)",
    )
    max_context_audio_s: Annotated[float, Field(gt=0)] = Field(
        120.0,
        description="seconds of the newest user audio each turn sends the engine (the conversation's context); "
        "an older turn's audio leaves it, the answer to it stays",
    )
    max_items: Annotated[int, Field(ge=2)] = Field(
        64, description="conversation items kept; the oldest are dropped from the context beyond it"
    )
    vad: VadDefaults = VadDefaults()


@dataclass(slots=True)
class VadParams:
    """Server VAD's parameters for one session, as its ``session.update`` set them over the defaults
    (gateway/realtime/vad.py runs them; it loads numpy and onnxruntime, so it is imported when a session
    first turns server VAD on, not with the app)."""

    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int
