"""Settings of the policies: the chains (pre, stream, post), media work's bounds and the grounding scorer."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from core.settings import Name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicySpec(_Strict):
    """One item of a policy chain."""

    name: Name = Field(description="the policy's entry-point name in group omnigate.policies")
    shadow: bool = Field(default=False, description="run and record the verdict, never act on it")
    on_error: Literal["fail_closed", "fail_open"] = Field(
        default="fail_closed",
        description="when the policy cannot judge (its model unavailable or failing, a part it cannot "
        "look at): fail_closed refuses the request (503 guard_unavailable); fail_open serves it, and its "
        "receipt says it was not scanned",
    )
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


ServedEndpoint = Literal[
    "score",
    "rerank",
    "classify",
    "tei-rerank",
    "tei-predict",
    "transcriptions",
    "chat-guard",
    "kserve-v2",
    "torchserve",
]


class ServedModelSettings(_Strict):
    """A guard model served by an engine (vLLM ``--runner pooling``, or TEI), called over HTTP, batched.

    The address and the model come from here only: nothing of a request reaches the call but its text.
    """

    url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")] = Field(
        description="the engine's base URL (http://host:port, without /v1): the endpoint's path is added"
    )
    model: str = Field(description="the model name the engine serves (vllm serve --served-model-name)")
    endpoint: ServedEndpoint = Field(
        default="score",
        description="score (vLLM /score, one-label cross-encoder), rerank (vLLM /rerank), classify (vLLM "
        "/classify), tei-rerank (TEI /rerank), tei-predict (TEI /predict), transcriptions (speech-to-text: "
        "/v1/audio/transcriptions, one call per file), chat-guard (a generative safety model through "
        "/v1/chat/completions, Llama Guard style: it answers safe, or unsafe and its category codes; one call "
        "per text), kserve-v2 (an image classifier through the Open Inference Protocol, POST "
        "/v2/models/{model}/infer, one tensor per batch), torchserve (an image classifier, POST "
        "/predictions/{model}, one image per call)",
    )
    labels: list[str] | None = Field(
        default=None,
        description="classify, kserve-v2: the model's labels in index order (its id2label); unset: named "
        "by index",
    )
    prompt: str | None = Field(
        default=None,
        description="chat-guard: the user turn sent, {text} standing for the screened text; unset: the text "
        "itself (a Llama Guard model's chat template wraps it in its own instructions and categories)",
    )
    choices: Annotated[list[str], Field(min_length=2)] | None = Field(
        default=None,
        description="chat-guard: the only answers the engine may give (vLLM structured outputs' choice), "
        "e.g. [safe, unsafe] for a general model the prompt asks to judge; unset: its own answer",
    )
    api_key: SecretStr | None = Field(default=None, description="sent as a bearer token, when set")
    max_batch: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=32, description="inputs of concurrent requests sent in one engine call, at most"
    )
    max_wait_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = Field(
        default=5.0, description="how long the first input of a batch waits for company"
    )
    timeout_s: Annotated[float, Field(gt=0.0, le=120.0)] = Field(
        default=2.0,
        description="the deadline of one judgement, batching wait included; past it the guard cannot judge "
        "(the policy's on_error applies)",
    )
    max_inflight: Annotated[int, Field(ge=1, le=256)] = Field(
        default=4, description="engine calls in flight at once (more batches wait for a slot)"
    )
    max_connections: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=8, description="the connection pool's size"
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        default=None,
        description="vLLM: cut each input to this many tokens (-1: the model's length) instead of refusing it",
    )

    @model_validator(mode="after")
    def _chat_guard_fields(self) -> ServedModelSettings:
        if self.endpoint != "chat-guard" and (self.prompt is not None or self.choices is not None):
            raise ValueError("prompt and choices are chat-guard's: this endpoint is " + self.endpoint)
        if self.prompt is not None and self.prompt.count("{text}") != 1:
            raise ValueError("prompt: write {text} once, where the screened text goes")
        return self


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
    subject_similarity: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=0.5,
        description="how close a claim and an evidence sentence must be to be about the same subject: a fact "
        "of the claim that differs from one such a sentence states is a contradiction (else unverifiable)",
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
    scorer: Literal["local", "served"] = Field(
        default="local",
        description="local: the model runs in the gateway (model, or the fallback); served: an engine "
        "serves it (served)",
    )
    served: ServedModelSettings | None = Field(
        default=None,
        description="scorer served: the NLI model's engine (endpoint score, rerank or tei-rerank for a "
        "one-label cross-encoder; classify for a model with an entailment label)",
    )
    tokenizer: str | None = Field(
        default=None,
        description="scorer served, endpoint classify: the model's tokenizer (a local folder or a name in "
        "the model cache): vLLM classifies premise-claim pairs only as token ids",
    )

    @model_validator(mode="after")
    def _served_named(self) -> GroundingSettings:
        if self.scorer == "served" and self.served is None:
            raise ValueError("grounding.served: scorer served needs the served model (url, model, endpoint)")
        if (
            self.scorer == "served"
            and self.served is not None
            and self.served.endpoint in ("tei-predict", "transcriptions")
        ):
            raise ValueError(
                f"grounding.served.endpoint: {self.served.endpoint} does not score premise-claim pairs"
            )
        served_classify = self.served is not None and self.served.endpoint == "classify"
        if self.scorer == "served" and served_classify and not self.tokenizer:
            raise ValueError("grounding.tokenizer: endpoint classify sends pairs as the model's token ids")
        return self


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


class ChainSettings(Protocol):
    """What a policy reads of the settings its chain is opened under (the gateway hands it the root model)."""

    @property
    def media(self) -> MediaSettings: ...
