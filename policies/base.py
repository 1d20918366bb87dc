"""The policy contract: three stages, one return type per hook.

A policy *plugin* is a class registered in the entry-point group
``omnigate.policies``. It declares:

``name``
    the entry-point name operators use in the config.
``stage``
    ``"pre"``, ``"stream"`` or ``"post"``.
``Config``
    a pydantic model for its ``config:`` block, validated at start-up.

and may declare:

``runs_after``
    names of policies that must run earlier in the same stage, not in shadow
    mode (the media policies need ``media-fetch`` to have turned every URL
    into data first); the chain is refused at start-up otherwise.
``async start(services)`` and ``async aclose()``
    called once by the app's lifespan: load models, open sessions, read the
    engine configuration (``services`` is :class:`gateway.services.Services`).

It is constructed once as ``Plugin(config)``. Then, by stage:

pre
    ``async pre(request, ctx) -> ChatCompletionRequest``: returns the request,
    rewritten or not, or raises an :class:`gateway.errors.OmnigateError` to refuse.
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

Per-stream state lives only in the object ``open_stream`` returns, never on the
plugin instance, which all requests share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, Union, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from engines.base import Completion, Delta
    from gateway.context import RequestContext
    from gateway.errors import OmnigateError
    from gateway.schemas import ChatCompletionRequest

Stage = Literal["pre", "stream", "post"]
StreamMode = Literal["passthrough", "window", "hold"]


class PolicyConfig(BaseModel):
    """Base for policy config models: unknown keys are an error, not a silent no-op."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class Accept:
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """Ask for another attempt; ``update`` is merged into the request for it."""

    reason: str
    update: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reject:
    error: "OmnigateError"


Verdict = Union[Accept, Retry, Reject]


class Policy(Protocol):
    name: ClassVar[str]
    stage: ClassVar[Stage]
    Config: ClassVar[type[PolicyConfig]]


@runtime_checkable
class PrePolicy(Protocol):
    async def pre(self, request: "ChatCompletionRequest", ctx: "RequestContext") -> "ChatCompletionRequest": ...


@runtime_checkable
class StreamFilter(Protocol):
    def feed(self, delta: "Delta") -> list["Delta"]: ...

    def finish(self) -> list["Delta"]: ...


@runtime_checkable
class StreamPolicy(Protocol):
    mode: StreamMode

    def open_stream(self, request: "ChatCompletionRequest", ctx: "RequestContext") -> StreamFilter: ...


@runtime_checkable
class PostPolicy(Protocol):
    async def post(
        self, request: "ChatCompletionRequest", completion: "Completion", ctx: "RequestContext"
    ) -> Verdict: ...


STAGE_PROTOCOL: dict[str, type] = {"pre": PrePolicy, "stream": StreamPolicy, "post": PostPolicy}
