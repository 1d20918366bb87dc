"""Per-request state: one :class:`RequestContext` per request, never shared.

Policies, the pipeline and the observability layer write what happened here; the
access log event and (later) the audit record are built from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gateway.admission import LoadSnapshot, Ticket

Outcome = Literal["served", "degraded", "refused", "failed", "cancelled"]


@dataclass(slots=True)
class PolicyRun:
    """One policy that actually executed (skipped ones are never recorded)."""

    name: str
    stage: str
    verdict: str
    duration_ms: float
    shadow: bool = False
    detail: str | None = None


@dataclass(slots=True)
class RequestContext:
    request_id: str
    body_bytes: int = 0
    tenant: str | None = None
    #: the tenant's request class, set by authentication; None: traffic.default_priority
    priority: str | None = None
    #: the class the client asked for with the priority header (it may only lower its own)
    requested_priority: str | None = None
    #: the tenant's concurrency quota across the gateway; None: no quota
    tenant_max_concurrency: int | None = None
    #: the admission slot this request holds, released once when the request finishes
    admission: "Ticket | None" = None
    #: the load the request was admitted under (what load shedding decides on)
    load: "LoadSnapshot | None" = None
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

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
