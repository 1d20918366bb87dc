"""When the gateway can answer: the one ``gateway_ready`` line, and a 503 on ``/v1/*`` until then.

uvicorn listens once the lifespan is done, but the engines are started and probed after it (a local
model may take a while to load), so there is a window where a request would find no engine. Until an
engine is healthy or every engine has had its first probe, ``/v1/*`` answers 503 with ``Retry-After``
(code ``gateway_starting``); from then on the gate is open for good. A gateway whose engines are all
down once started is no longer starting: its requests get the pipeline's own answer (a 503 naming the
engines, or a 4xx for a bad request), not "starting" for ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import OmnigateError, Overloaded
from engines.selection.pool import EnginePool

log = structlog.get_logger(__name__)

_RETRY_AFTER_S = 1.0
_POLL_S = 0.05


class Readiness:
    """Open once an engine is healthy or every engine has been probed; it is never closed again."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        self._open = False
        self._announced: asyncio.Task[None] | None = None

    @property
    def open(self) -> bool:
        # Read from the pool on every call until it opens: a caller that saw pool.ready is never refused.
        if not self._open and (self._pool.ready or self._pool.started):
            self._open = True
        return self._open

    def announce(self, url: str) -> None:
        """Log ``gateway_ready`` with ``url`` once the gateway can answer (now, or when it first can)."""
        if self.open:
            self._ready(url)
            return
        log.info(
            "gateway_listening",
            url=url,
            detail="waiting for an engine to answer its health probe; /v1/* answers 503 until then",
        )
        self._announced = asyncio.get_running_loop().create_task(self._announce_later(url))

    async def _announce_later(self, url: str) -> None:
        # The engines' health has no event to wait on; a short poll, for one log line at the start.
        while not self.open:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        self._ready(url)

    def _ready(self, url: str) -> None:
        if self._pool.ready:
            log.info("gateway_ready", url=url)
        else:
            log.warning(
                "gateway_ready", url=url, detail="no engine answered its first health probe: requests get 503"
            )

    def cancel(self) -> None:
        if self._announced is not None:
            self._announced.cancel()


class ReadinessGate:
    """Pure ASGI: ``/v1/*`` before the gateway is ready gets 503 with ``Retry-After`` (rendered by ``render``,
    the app's one error renderer)."""

    def __init__(
        self, app: ASGIApp, readiness: Readiness, render: Callable[[OmnigateError], Response]
    ) -> None:
        self.app = app
        self.readiness = readiness
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self.readiness.open:
            refused = Overloaded(
                "the gateway is starting: no engine has answered its health probe yet; retry shortly",
                code="gateway_starting",
                retry_after=_RETRY_AFTER_S,
            )
            await self.render(refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)
