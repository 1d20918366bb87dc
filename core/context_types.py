"""The types :mod:`core.context` is made of: the protocols of what a request holds and gives back once
(:class:`Lease`, :class:`EngineSlot`, :class:`MediaBudget`), its trace (:class:`Trace`), the load it was
admitted under (:class:`LoadSnapshot`), the entries of its record (:class:`PolicyRun`, :class:`Scan`,
:class:`MediaRecord`, :class:`Screening`) and a segmentation's plan (:class:`SegmentPlan`).

Split from :mod:`core.context`, which re-exports every name here. Declarations, with two small readings
of them: whether a load is above its soft limit, and a guard's scan as its receipt's JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class EngineSlot(Protocol):
    """The engine slot a request's current attempt holds (engines/selection/slots.py's ``Lease``), settled once:
    ``reported`` says whether the request's outcome was reported for the engine (if not, a half-open
    trial is given back to its circuit)."""

    def settle(self, *, reported: bool) -> None: ...


class MediaBudget(Protocol):
    """The media bytes one request holds (policies/media/sandbox.py's ``RequestBudget``): the media steps
    take from it, the pipeline releases it when the request ends."""

    @property
    def room(self) -> int: ...

    async def take(self, n: int, param: str) -> None: ...

    def release(self) -> None: ...


class Trace(Protocol):
    """A request's trace (observability/tracing.py's ``RequestTrace``), when tracing is on: the pipeline
    tells it where a step ended; it makes the spans. Absent (``ctx.trace is None``) when tracing is off."""

    trace_id: str
    span_id: str

    @property
    def sampled(self) -> bool: ...

    def admission(self, seconds: float, outcome: str, load: LoadSnapshot | None) -> None: ...

    def policy(
        self,
        name: str,
        stage: str,
        verdict: str,
        seconds: float,
        *,
        shadow: bool,
        score: float | None,
        attempt: int,
    ) -> None: ...

    def attempt(self, engine: str, variant: str | None, model: str, provider: str) -> object: ...

    def attempt_failed(self, error: BaseException) -> None: ...

    def audit(self, seconds: float, seq: int | None, error: BaseException | None) -> None: ...

    def finished(self, record: Mapping[str, Any]) -> None: ...

    def end(self) -> None: ...


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
class Scan:
    """What one guard looked at on one request, as the guard reports it: its receipt's facts (the
    pipeline adds the verdict, the mode and the score; observability/audit/record.py writes the receipt).

    ``parts`` says what it judged, one entry a media part (``part``, ``kind``, and per kind ``width`` and
    ``height`` of what it scored, ``frames`` of ``of``, ``ms`` and ``segments``); ``missed`` what it did not
    look at and why (``part`` or ``"*"`` for the whole request, ``why``): "unavailable" is never "clean".
    """

    #: the messages whose text it screened, and their characters
    messages: list[int] = field(default_factory=list)
    chars: int = 0
    parts: list[dict[str, Any]] = field(default_factory=list)
    missed: list[dict[str, str]] = field(default_factory=list)
    #: the model that judged (its name) and the digest of its weights or its version
    model: str | None = None
    model_digest: str | None = None
    threshold: float | None = None
    #: what its ``on_error`` did, where it could not look (``fail_closed``: refused; ``fail_open``: served)
    on_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.messages:
            out["text"] = {"messages": list(self.messages), "chars": self.chars}
        for key in ("parts", "missed"):
            if getattr(self, key):
                out[key] = [dict(x) for x in getattr(self, key)]
        for key in ("model", "model_digest", "threshold", "on_error"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


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
