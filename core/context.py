"""Per-request state: one :class:`RequestContext` per request, never shared, in three parts by owner.

- :class:`Identity`: who is asking, as the front door established it (frozen: set once, before the
  pipeline, by replacing it whole; nothing after the front door can change who the request is from).
- :class:`Record`: what happened to the request, written by the pipeline and its collaborators
  (gateway/pipeline/: the attempt loop, the relay, the accounting); policies read it, never write it.
- :class:`PolicyOutputs`: what the policies found and did, one typed field per kind of fact (the media
  they saw, the screenings, the degradations, the headers and notes of the verdicts acted on).

Beside them, the inputs the gateway gives policies (``load``, ``retries_left``) and what the request
holds and gives back once when it ends (its admission slot, its chain generation, its engine slot, its
media budget). Each is entered on the request's :attr:`RequestContext.holds` the moment it is put on
the context, so it is given back when that stack closes, whatever ended the request; nobody has to
remember to release it. The kernel knows those only by what is called on them (:class:`Lease`,
:class:`EngineSlot`, :class:`MediaBudget`), never by their classes above it. The access log event and the audit
record are built from the three parts. A segmentation is not here: it is a plan a pre-policy returns
with the request it rewrote (:class:`SegmentPlan`, policies/base.py ``Segmented``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

# Re-exported: the protocols of what a request holds and the records' entries are imported from here.
from core.context_types import EngineSlot as EngineSlot
from core.context_types import Lease as Lease
from core.context_types import LoadSnapshot as LoadSnapshot
from core.context_types import MediaBudget as MediaBudget
from core.context_types import MediaRecord as MediaRecord
from core.context_types import PolicyRun as PolicyRun
from core.context_types import Scan as Scan
from core.context_types import Screening as Screening
from core.context_types import SegmentPlan as SegmentPlan
from core.context_types import Trace as Trace
from core.digest import OutputDigest

if TYPE_CHECKING:
    from core.events import Completion
    from core.schemas import ChatCompletionRequest
    from core.settings import TenantConfig

Outcome = Literal["served", "degraded", "refused", "failed", "cancelled"]

#: the degradation reason of a speech request served text-only above its soft limit
DEGRADED_TEXT_ONLY = "load-text-only"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is asking. Made by the transport, completed by authentication (:meth:`authenticated`), then
    read by admission, the policies, the accounting and the audit record."""

    #: made by the gateway for every request; a client cannot choose it
    request_id: str
    #: the id the client sent (``x-client-request-id`` or ``x-request-id``), sanitised; recorded beside it
    client_request_id: str | None = None
    #: the class the client asked for with the priority header (it may only lower its own)
    requested_priority: str | None = None
    tenant: str | None = None
    #: the resolved tenant (models, policy set, limits); None when authentication is off
    tenant_config: TenantConfig | None = None
    #: the API key's public id (never the key); None when authentication is off, or the key is unknown
    key_id: str | None = None
    #: priority class and concurrency quota of the tenant, read by admission
    #: (priority None: unauthenticated, the class is traffic.default_priority)
    priority: str | None = None
    tenant_max_concurrency: int | None = None
    #: the tenant's policy set (None: the default chain) and what the audit keeps of content
    policy_set: str | None = None
    audit_content: str = "digests"

    def authenticated(self, tenant: TenantConfig, key_id: str) -> Identity:
        """This identity with the tenant a key resolved to."""
        return replace(
            self,
            tenant=tenant.name,
            tenant_config=tenant,
            key_id=key_id,
            priority=tenant.priority,
            tenant_max_concurrency=tenant.max_concurrency,
            policy_set=tenant.policy_set,
            audit_content=tenant.audit_content,
        )

    def refused(self, key_id: str | None) -> Identity:
        """This identity after a refused key: its public id only, if the key named one."""
        return replace(self, key_id=key_id)


@dataclass(slots=True)
class Record:
    """What happened to the request: written by the pipeline and its collaborators only."""

    started: float = field(default_factory=time.perf_counter)
    body_bytes: int = 0
    public_model: str | None = None
    stream: bool = False
    #: what the audit record is built from: the request as received and what was released
    received: ChatCompletionRequest | None = None
    #: the digests of the received parts (a list, or the task making it), once the pipeline has let go of
    #: the client's media strings; ``received`` then keeps the text only (observability/audit/record.py)
    input_digests: Any = None
    output: OutputDigest | None = None
    completion: Completion | None = None
    #: the model's sampling defaults this request was given (the parameters it did not set itself)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: seconds into the original part of each segment, when a pre-policy cut a long input into several
    segments: list[tuple[float, float]] | None = None
    #: the admission's decision on this request (result, class, counts, limits), for the audit record
    admission: dict[str, Any] | None = None
    engine: str | None = None
    variant: str | None = None
    attempts: int = 0
    retries: int = 0
    policy_runs: list[PolicyRun] = field(default_factory=list)
    outcome: Outcome | None = None
    error_code: str | None = None
    status: int = 200
    ttft_s: float | None = None
    first_audio_s: float | None = None
    #: the served engine call's own latencies: from sending it to its first token (streamed) and to its end
    upstream_ttft_s: float | None = None
    upstream_e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: seconds of speech served (speech adds no completion tokens)
    audio_seconds: float = 0.0
    #: who counted the answer's tokens: None, the engine (its usage); "gateway", an answer cut before the
    #: engine's usage came (the client left, the engine failed mid-stream), counted from what was relayed
    usage_counted_by: str | None = None
    #: why the served answer ended (``stop``, ``length``, ``tool_calls``...), as the engine said
    finish_reason: str | None = None
    #: estimated GPU energy of the answer (engines/rollout/energy.py), None without power telemetry for its engine
    energy_joules: float | None = None
    #: the realtime session this request is a turn of (its id, the turn's index, its input audio's digest
    #: and duration), for the audit record; None: not a turn of a session (gateway/realtime)
    realtime: dict[str, Any] | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@dataclass(slots=True)
class PolicyOutputs:
    """What the policies found and did (and the pipeline, acting on their verdicts), typed by kind."""

    #: each media part as the media steps found it and what they did to it
    media: list[MediaRecord] = field(default_factory=list)
    #: classifier verdicts on parts as the engine receives them
    screenings: list[Screening] = field(default_factory=list)
    #: why the answer is less than asked for (``x-omnigate-degraded``), in the order it happened
    degraded: list[str] = field(default_factory=list)
    #: text of input audio, where a pre-policy transcribed it (part of the grounding premise)
    input_transcripts: list[str] = field(default_factory=list)
    #: headers verdicts added before the response started (``x-omnigate-grounding``, ...)
    response_headers: dict[str, str] = field(default_factory=dict)
    #: facts verdicts report (audit record; sent as the stream's final event)
    notes: dict[str, Any] = field(default_factory=dict)
    #: the traffic decisions policies made, by control loop (``shedding``); the audit record's ``control``
    #: holds them beside the admission's (``Record.admission``)
    control: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what each guard looked at, by policy name (its receipt's facts; kept for a shadow policy too)
    scans: dict[str, Scan] = field(default_factory=dict)

    def scan(self, policy: str) -> Scan:
        """The policy's :class:`Scan` on this request, made on first use."""
        found = self.scans.get(policy)
        if found is None:
            found = self.scans[policy] = Scan()
        return found

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def mark(self) -> tuple[int, frozenset[str]]:
        """Where the degradations and control decisions stand now, for :meth:`undo`."""
        return len(self.degraded), frozenset(self.control)

    def undo(self, mark: tuple[int, frozenset[str]]) -> None:
        """Forget the degradations and control decisions made since ``mark``: a shadow policy's rewrite
        is not served, so it is neither announced nor audited as done (what it saw and screened stays)."""
        degraded, control = mark
        del self.degraded[degraded:]
        for key in set(self.control) - control:
            del self.control[key]


@dataclass(slots=True)
class RequestContext:
    """One request's state, never shared: who asks, what happened, what the policies found, and what
    the request holds until it ends. Policies read ``identity``, ``record``, ``load`` and
    ``retries_left`` and write only ``outputs`` (and the media budget the media steps open)."""

    identity: Identity
    record: Record = field(default_factory=Record)
    outputs: PolicyOutputs = field(default_factory=PolicyOutputs)
    #: the load the request was admitted under (what load shedding decides on), set by admission
    load: LoadSnapshot | None = None
    #: retries the pipeline can still make for this request (a streaming check reads it)
    retries_left: int = 0
    #: what the request holds, as the releases to run when it ends: each holding below is entered here
    #: when it is put on the context. The transport enters this stack on the request's own
    #: ``AsyncExitStack`` (gateway/pipeline ``Pipeline.lifetime``), so it closes however the request ends;
    #: the accounting closes it as soon as the request is accounted for. A plain ``ExitStack``: every
    #: release is a synchronous count given back, so it runs to its end even in a task being cancelled,
    #: and closing it twice is harmless (the second close finds nothing left).
    holds: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)
    #: the request is counted in the in-flight gauge (a holding too: its release is on ``holds``)
    counted: bool = False
    #: the request's trace (spans of its steps); None when tracing is off, and then nothing is traced
    trace: Trace | None = field(default=None, repr=False)
    _admission: Lease | None = field(default=None, repr=False)
    _policies: Lease | None = field(default=None, repr=False)
    _lease: EngineSlot | None = field(default=None, repr=False)
    _media_budget: MediaBudget | None = field(default=None, repr=False)

    @classmethod
    def new(cls, request_id: str, **identity: Any) -> RequestContext:
        return cls(Identity(request_id, **identity))

    # What the request holds, each given back once when it ends (when ``holds`` closes):
    @property
    def admission(self) -> Lease | None:
        """The admission slot (gateway/admission.py's Ticket)."""
        return self._admission

    @admission.setter
    def admission(self, ticket: Lease | None) -> None:
        if ticket is not None and ticket is not self._admission:
            self.holds.callback(ticket.release)
        self._admission = ticket

    @property
    def policies(self) -> Lease | None:
        """The chain generation the request began on and runs to its end (a reload does not move it)."""
        return self._policies

    @policies.setter
    def policies(self, generation: Lease | None) -> None:
        if generation is not None and generation is not self._policies:
            self.holds.callback(generation.release)
        self._policies = generation

    @property
    def lease(self) -> EngineSlot | None:
        """The engine slot the current attempt holds. The pipeline settles it with the request's outcome;
        one it has not settled when the request ends is given back with none reported."""
        return self._lease

    @lease.setter
    def lease(self, slot: EngineSlot | None) -> None:
        if slot is not None and slot is not self._lease:
            self.holds.callback(slot.settle, reported=False)
        self._lease = slot

    @property
    def media_budget(self) -> MediaBudget | None:
        """The media bytes this request holds (opened by the first media step that takes from it)."""
        return self._media_budget

    @media_budget.setter
    def media_budget(self, budget: MediaBudget | None) -> None:
        if budget is not None and budget is not self._media_budget:
            self.holds.callback(budget.release)
        self._media_budget = budget
