"""A pure ASGI Server-Sent Events response that is pulled, bounded and always cleaned up.

The frame iterator advances only after ``send`` returns (backpressure). A
listener races the body against ``http.disconnect``; when the client leaves,
the body is cancelled and ``on_close`` runs shielded, which closes the upstream
request. Idle streams get keep-alive comments. When the gateway drains for
shutdown, a stream still open at the drain deadline ends with an error frame and
``[DONE]`` instead of being cut off.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

import anyio
import structlog
from starlette.responses import Response

from gateway.errors import Overloaded
from gateway.render import error_frame

log = structlog.get_logger(__name__)

_KEEPALIVE = b": keep-alive\n\n"
_CLEANUP_TIMEOUT_S = 10.0


class SSEResponse(Response):
    """A Starlette ``Response`` only so frameworks pass it through untouched."""

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
        keepalive_s: float = 15.0,
        drain: asyncio.Event | None = None,
        drain_deadline: Callable[[], float | None] | None = None,
    ) -> None:
        self._frames = frames
        self._on_close = on_close
        self._keepalive_s = keepalive_s
        raw = {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
        }
        raw.update({k.lower(): v for k, v in (headers or {}).items()})
        self._headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in raw.items()]
        self.status_code = 200
        self.background = None
        self.raw_headers = self._headers
        self._last_send = 0.0
        self._drain = drain
        self._drain_deadline = drain_deadline
        self._cut = False

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI callables
        # asyncio's Lock costs nothing uncontended; anyio's yields to the loop on every acquire.
        lock = asyncio.Lock()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._listen_for_disconnect, receive, tg.cancel_scope)
                tg.start_soon(self._keepalive, send, lock)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self._headers})
                    with anyio.CancelScope() as pump_scope:
                        if self._drain is not None:
                            tg.start_soon(self._cut_at_drain_deadline, pump_scope)
                        await self._pump(send, lock)
                    if self._cut:
                        shutting_down = Overloaded("the gateway is shutting down; retry the request", code="shutting_down")
                        async with lock:
                            await send({"type": "http.response.body", "body": error_frame(shutting_down),
                                        "more_body": False})
                except OSError:
                    log.info("client_gone_during_send")
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True):
                await self._on_close()

    async def _pump(self, send, lock: asyncio.Lock) -> None:  # noqa: ANN001
        async for frame in self._frames:
            async with lock:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            self._last_send = time.monotonic()
        async with lock:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _keepalive(self, send, lock: asyncio.Lock) -> None:  # noqa: ANN001
        self._last_send = time.monotonic()
        while True:
            await anyio.sleep(self._keepalive_s)
            if time.monotonic() - self._last_send >= self._keepalive_s:
                async with lock:
                    await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                self._last_send = time.monotonic()

    async def _cut_at_drain_deadline(self, pump_scope: anyio.CancelScope) -> None:
        assert self._drain is not None and self._drain_deadline is not None
        await self._drain.wait()
        deadline = self._drain_deadline()
        if deadline is not None:
            await anyio.sleep(max(0.0, deadline - time.monotonic()))
        self._cut = True
        pump_scope.cancel()

    @staticmethod
    async def _listen_for_disconnect(receive, scope: anyio.CancelScope) -> None:  # noqa: ANN001
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return
