"""Per-request state: one :class:`RequestContext` per request, never shared.

Policies, the pipeline and the observability layer write what happened here; the
access log event and the audit record are built from it. The kernel knows the gateway's
per-request leases (the admission slot, the policy chain generation) only as :class:`Lease`:
the gateway puts them here and lets go of them, through ``release``, when the request ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.digest import OutputDigest

if TYPE_CHECKING:
    from core.events import Completion
    from core.schemas import ChatCompletionRequest
    from core.settings import TenantConfig

Outcome = Literal["served", "degraded", "refused", "failed", "cancelled"]

#: the degradation reason of a speech request served text-only above its soft limit
DEGRADED_TEXT_ONLY = "load-text-only"


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The load a request arrived at (admitted or refused); the ``load-shedding`` policy decides on it."""

    priority: str
    in_flight: int  # admitted requests in flight when this one arrived, not counting it
    soft_limit: int
    hard_limit: int
    store: str  # "local" or "redis"

    @property
    def above_soft_limit(self) -> bool:
        return self.in_flight >= self.soft_limit


class Lease(Protocol):
    """Something a request holds from start to end and gives back once (gateway/admission.py's
    ``Ticket``, gateway/chains.py's ``ChainSet`` generation)."""

    def release(self) -> None: ...


@dataclass(slots=True)
class PolicyRun:
    """One policy that actually executed (skipped ones are never recorded)."""

    name: str
    stage: str
    verdict: str
    duration_ms: float
    shadow: bool = False
    detail: str | None = None
    attempt: int = 1
    score: float | None = None


@dataclass(slots=True)
class MediaRecord:
    """One media content part as the media policies found it and what they did to it (audit)."""

    part: str  # where the client put it, e.g. "messages.0.content.1"
    kind: str  # image | audio | video
    source: str  # url | data
    host: str | None = None  # the URL's host (never the full URL: it may carry tokens)
    bytes: int = 0
    format: str | None = None
    width: int | None = None
    height: int | None = None
    duration_s: float | None = None
    frames: int | None = None
    modal_tokens: int = 0
    actions: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Screening:
    """One classifier verdict on a part as the engine receives it (e.g. NSFW score)."""

    policy: str
    part: str
    score: float
    flagged: bool


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """A long input cut into consecutive segments: what the pipeline executes, one engine call per segment.

    Data, not code to call back: the request the pre-policies return carries segment 0 as the content
    part ``first``; the request for segment ``i`` is that request with ``first`` replaced by ``parts[i]``
    (``gateway/pipeline/segments.py`` makes it). ``parts`` is a sequence of content parts (it may make each
    on access, so only one segment's media is held at a time). ``boundaries`` are seconds into the
    original part, kept for the audit record.
    """

    part: str
    boundaries: list[tuple[float, float]]
    first: Any
    parts: Sequence[Any]
    separator: str = "\n\n"


@dataclass(slots=True)
class RequestContext:
    #: made by the gateway for every request; a client cannot choose it
    request_id: str
    #: the id the client sent (``x-client-request-id`` or ``x-request-id``), sanitised; recorded beside it
    client_request_id: str | None = None
    body_bytes: int = 0
    tenant: str | None = None
    #: the resolved tenant (models, policy set, limits); None when authentication is off
    tenant_config: TenantConfig | None = None
    #: the API key's public id (never the key); None when authentication is off or failed
    key_id: str | None = None
    #: priority class and concurrency quota of the tenant, read by admission
    #: (priority None: unauthenticated, the class is traffic.default_priority)
    priority: str | None = None
    tenant_max_concurrency: int | None = None
    #: the class the client asked for with the priority header (it may only lower its own)
    requested_priority: str | None = None
    #: the admission slot this request holds, released once when the request finishes
    admission: Lease | None = None
    #: the engine slot the request's current attempt holds (an engines.slots.Lease: the kernel imports
    #: nothing above it), settled once by the pipeline
    lease: Any = None
    #: the load the request was admitted under (what load shedding decides on)
    load: LoadSnapshot | None = None
    #: the tenant's policy set (None: the default chain) and what the audit keeps of content
    policy_set: str | None = None
    audit_content: str = "digests"
    #: the chain generation the request began on and runs to its end (a reload does not move it)
    policies: Lease | None = None
    #: shedding and rollback state when the request was served, written by the readers of the control loops
    control_state: dict[str, Any] = field(default_factory=dict)
    #: what the audit record is built from: the request as received and what was released
    received: ChatCompletionRequest | None = None
    #: the digests of the received parts (a list, or the task making it), once the pipeline has let go of
    #: the client's media strings; ``received`` then keeps the text only (observability/audit/record.py)
    input_digests: Any = None
    output: OutputDigest | None = None
    completion: Completion | None = None
    started: float = field(default_factory=time.perf_counter)
    public_model: str | None = None
    stream: bool = False
    engine: str | None = None
    variant: str | None = None
    attempts: int = 0
    retries: int = 0
    degraded: list[str] = field(default_factory=list)
    policy_runs: list[PolicyRun] = field(default_factory=list)
    outcome: Outcome | None = None
    error_code: str | None = None
    status: int = 200
    ttft_s: float | None = None
    first_audio_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: the served engine call's own latencies: from sending it to its first token (streamed) and to its end
    upstream_ttft_s: float | None = None
    upstream_e2e_s: float | None = None
    #: seconds of speech served (speech adds no completion tokens)
    audio_seconds: float = 0.0
    #: estimated GPU energy of the answer (engines/energy.py), None without power telemetry for its engine
    energy_joules: float | None = None
    media: list[MediaRecord] = field(default_factory=list)
    screenings: list[Screening] = field(default_factory=list)
    #: the segments a pre-policy cut a long input into (the pipeline makes one engine call per segment)
    segmentation: SegmentPlan | None = None
    #: the media bytes this request holds (policies/media/sandbox.RequestBudget); released by the pipeline
    media_budget: Any = None
    #: retries the pipeline can still make for this request (a streaming check reads it)
    retries_left: int = 0
    #: headers verdicts added before the response started (``x-omnigate-grounding``, ...)
    response_headers: dict[str, str] = field(default_factory=dict)
    #: facts policies report (audit record; sent as the stream's final event)
    notes: dict[str, Any] = field(default_factory=dict)
    #: the model's sampling defaults this request was given (the parameters it did not set itself)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: text of input audio, where a pre-policy transcribed it (part of the grounding premise)
    input_transcripts: list[str] = field(default_factory=list)

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
