"""The policy contract: three stages, one return type per hook, and one lifecycle.

A policy *plugin* is a class registered in the entry-point group
``omnigate.policies``. It declares:

``name``
    the entry-point name operators use in the config.
``stage``
    ``"pre"``, ``"stream"`` or ``"post"``.
``Config``
    a pydantic model for its ``config:`` block, validated at start-up.

and the lifecycle of :class:`Policy`, whose defaults :class:`PolicyBase` gives (a
plugin subclasses it, or declares every member itself; the registry checks
either when it loads the plugin):

``uses: frozenset[str]``
    the shared resources it needs (``{"scorer"}``, one of :data:`RESOURCES`), so
    the gateway builds and loads them only when a configured policy asks.
``runs_after: tuple[str, ...]``
    names of policies that must run earlier in the same stage, not in shadow
    mode (the media policies need ``media-fetch`` to have turned every URL
    into data first); the chain is refused at start-up otherwise.
``media_only: bool``
    skipped (not run, not recorded) for requests without media parts.
``async start(deps)``
    called once per instance before the chain serves (at boot, or by a reload
    before the swap): load models, open sessions, read the engines, take shared
    resources from ``deps`` (:class:`Deps`). Raising refuses the chain: at boot
    the gateway does not start; on reload the file is refused, what was already
    started is closed and the running chain keeps serving.
``async aclose()``
    called once, after the last request that took the chain ended, in the
    reverse order of ``start``; only for instances whose ``start`` returned. It
    releases what ``start`` opened and nothing in ``deps``: those belong to the
    gateway and outlive a reload.

It is constructed once per chain generation as ``Plugin(config)``. Then, by stage:

pre
    ``async pre(request, ctx) -> ChatCompletionRequest | Segmented``: returns the
    request, rewritten or not, or raises an :class:`core.errors.OmnigateError` to
    refuse. A policy that cuts one long input into consecutive engine calls returns
    :class:`Segmented`: the rewritten request (carrying the first segment) with the
    plan (:class:`core.context.SegmentPlan`) the pipeline executes. A plan is data
    returned with its request, never left on the context: a shadow policy's rewrite,
    plan included, is recorded and not served.
stream
    ``open_stream(request, ctx) -> StreamFilter``: a fresh per-stream object whose
    ``feed(delta)`` returns the deltas to release now and ``finish()`` the rest at
    the end; raising terminates the stream. ``mode`` declares what it can do:
    ``passthrough`` (releases at once, can only terminate), ``window`` (holds a
    bounded window back, can block), ``hold`` (releases nothing until the end).
post
    ``async post(request, completion, ctx) -> Verdict``: :class:`Accept`,
    :class:`Retry` (the pipeline retries while nothing has been sent and budget
    remains) or :class:`Reject`.

    A post policy may also *watch a stream* (a streaming post-check): it then
    declares ``stream_mode(request, ctx) -> StreamMode`` and
    ``open_check(request, ctx) -> StreamCheck``. For streamed requests the
    pipeline feeds the check what the stream filters release, releases only
    what the check clears, and takes the check's ``finish()`` verdict instead of
    calling ``post``. ``hold`` and ``window`` checks can block or retry (until
    their first release); a ``passthrough`` check can only record and terminate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from core.capabilities import EngineFacts
    from core.context import RequestContext, SegmentPlan
    from core.errors import OmnigateError
    from core.events import Completion, Delta
    from core.schemas import ChatCompletionRequest
    from observability.metrics import Metrics
    from policies.settings import ChainSettings

Stage = Literal["pre", "stream", "post"]
StreamMode = Literal["passthrough", "window", "hold"]


class PolicyConfig(BaseModel):
    """Base for policy config models: unknown keys are an error, not a silent no-op."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class Accept:
    """Serve the answer.

    ``headers`` are response headers the pipeline adds when it acts on this
    verdict while the response has not started; ``notes`` are facts for the
    audit record and for the stream's final event (see the grounding policy's page).
    """

    detail: str | None = None
    score: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    notes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Retry:
    """Ask for another attempt; ``update`` is merged into the request for it.

    ``score`` ranks attempts. ``exhausted`` says what to do when no retry is
    possible (budget spent, or something was already released): ``Reject`` ends
    the request with its error; ``Accept`` serves the best-scoring attempt with
    that verdict's headers and notes; ``None`` serves the last attempt flagged
    ``retries-exhausted``.
    """

    reason: str
    update: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    exhausted: Accept | Reject | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    error: OmnigateError


Verdict = Accept | Retry | Reject


class Halt(Exception):
    """Raised by a :class:`StreamCheck`'s ``feed``: this attempt is judged before its end.

    The pipeline stops reading the attempt's upstream and acts on ``verdict``
    exactly as on a verdict at the end of the stream.
    """

    def __init__(self, verdict: Retry | Reject) -> None:
        super().__init__(type(verdict).__name__)
        self.verdict = verdict


#: the shared resources a policy may name in ``uses``: the gateway builds one only when a configured
#: policy names it (the media runtime it always has: the media steps are fixed)
RESOURCES = frozenset({"scorer"})


@dataclass(frozen=True, slots=True)
class Deps:
    """What a policy's ``start`` may use; all of it owned by the gateway, kept across reloads.

    ``settings`` are the settings the chain is opened under (on reload: the new file, with the
    sections that need a restart kept as booted); ``engines`` what each engine that serves takes, as
    its adapter declares it; ``resources`` the gateway's shared resources by name: ``media``, the
    process's media sandbox and byte budgets (absent outside a gateway: a policy that needs one then
    opens its own and closes it in ``aclose``), and ``scorer``, the grounding scorer, loaded, when a
    configured policy ``uses`` it. A policy takes a resource by name and checks its type there
    (``isinstance``), so this protocol module names no policy's types.
    """

    settings: ChainSettings
    metrics: Metrics
    resources: Mapping[str, object] = field(default_factory=dict)
    #: the gateway's own call to the engines it routes to (:class:`EngineChat`), for a guard that asks
    #: an engine a question (the grounding guard's image check); None outside a gateway
    engine_chat: EngineChat | None = None
    #: what each engine serves and takes, as its adapter declares it (core/capabilities.py): the media
    #: steps read the engines' modalities, video form, audio rate and context here, not in the settings
    engines: tuple[EngineFacts, ...] = ()


@runtime_checkable
class EngineChat(Protocol):
    """One whole chat completion from an engine that serves ``request.model``, chosen, capped and failed
    over as the gateway routes clients' requests, within ``timeout_s``. A guard's question to an engine:
    it takes no client's admission slot and writes no audit record of its own. Raises
    :class:`core.errors.GuardUnavailable` when no engine answers in time."""

    async def __call__(self, request: ChatCompletionRequest, *, timeout_s: float) -> Completion: ...


@runtime_checkable
class Policy(Protocol):
    """What every policy is, whatever its stage (the stage hooks are the protocols below)."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    Config: ClassVar[type[PolicyConfig]]
    uses: ClassVar[frozenset[str]]
    runs_after: ClassVar[tuple[str, ...]]
    media_only: ClassVar[bool]

    async def start(self, deps: Deps) -> None: ...

    async def aclose(self) -> None: ...


class PolicyBase:
    """The lifecycle's defaults: no shared resources, no order constraint, nothing to open or close."""

    uses: ClassVar[frozenset[str]] = frozenset()
    runs_after: ClassVar[tuple[str, ...]] = ()
    media_only: ClassVar[bool] = False

    async def start(self, deps: Deps) -> None:
        return None

    async def aclose(self) -> None:
        return None


@runtime_checkable
class LoadShedder(Protocol):
    """A pre-policy that acts on the admission's decision (``ctx.load``): above a class's soft limit it
    serves less instead of refusing (the built-in ``load-shedding`` serves speech as text). The gateway
    finds it by this, whatever its name, and warns at start-up about a chain with admission limits and
    no shedder."""

    sheds_load: ClassVar[bool]


@dataclass(frozen=True, slots=True)
class Segmented:
    """A pre-policy's rewrite that also cuts one long input into segments: ``request`` carries segment 0,
    ``plan`` says how to make the others. The pipeline makes one engine call per segment and joins them.
    A later pre-policy that returns another plan replaces it (one input per request is cut)."""

    request: ChatCompletionRequest
    plan: SegmentPlan


@runtime_checkable
class PrePolicy(Protocol):
    async def pre(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> ChatCompletionRequest | Segmented: ...


@runtime_checkable
class StreamFilter(Protocol):
    def feed(self, delta: Delta) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


@runtime_checkable
class StreamPolicy(Protocol):
    mode: StreamMode

    def open_stream(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamFilter: ...


@runtime_checkable
class PostPolicy(Protocol):
    async def post(
        self, request: ChatCompletionRequest, completion: Completion, ctx: RequestContext
    ) -> Verdict: ...


@runtime_checkable
class StreamCheck(Protocol):
    """The per-attempt object of a streaming post-check.

    ``feed`` returns the deltas cleared for release now (it may raise
    :class:`Halt`); ``finish`` gives the verdict on the whole answer once the
    upstream ended; ``release`` hands over what is still held back, which the
    pipeline sends only after every verdict accepted (or when it serves this
    attempt anyway).
    """

    async def feed(self, delta: Delta) -> list[Delta]: ...

    async def finish(self) -> Verdict: ...

    def release(self) -> list[Delta]: ...


@runtime_checkable
class StreamingPostPolicy(Protocol):
    def stream_mode(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamMode: ...

    def open_check(self, request: ChatCompletionRequest, ctx: RequestContext) -> StreamCheck: ...


STAGE_PROTOCOL: dict[str, type] = {"pre": PrePolicy, "stream": StreamPolicy, "post": PostPolicy}
