"""Per-request state: one :class:`RequestContext` per request, never shared.

Policies, the pipeline and the observability layer write what happened here; the
access log event and (later) the audit record are built from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

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
    attempt: int = 1
    score: float | None = None


@dataclass(slots=True)
class RequestContext:
    request_id: str
    body_bytes: int = 0
    tenant: str | None = None
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
    #: retries the pipeline can still make for this request (a streaming check reads it)
    retries_left: int = 0
    #: headers verdicts added before the response started (``x-omnigate-grounding``, ...)
    response_headers: dict[str, str] = field(default_factory=dict)
    #: facts policies report (audit record; sent as the stream's final event)
    notes: dict[str, Any] = field(default_factory=dict)
    #: text of input audio, where a pre-policy transcribed it (part of the grounding premise)
    input_transcripts: list[str] = field(default_factory=list)

    def degrade(self, reason: str) -> None:
        if reason not in self.degraded:
            self.degraded.append(reason)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
