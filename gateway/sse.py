"""A pure ASGI Server-Sent Events response that is pulled, bounded and always cleaned up.

The frame iterator advances only after ``send`` returns (backpressure). The
frames are pumped in the request's own task; one watcher task waits for
``http.disconnect`` and, when the client leaves, cancels the pump, after which
``on_close`` closes the upstream request. Idle streams get keep-alive comments
from a loop timer. When the gateway drains for shutdown, a stream still open at
the drain deadline (see :class:`OpenStreams`) ends with an error frame and
``[DONE]`` instead of being cut off.

Nothing here uses a task group: on the path to the first token, a task group's
setup and its extra hops through the event loop cost more than the rest of the
response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from core.errors import Overloaded
from gateway.render import error_frame

log = structlog.get_logger(__name__)

_KEEPALIVE = b": keep-alive\n\n"
_CLEANUP_TIMEOUT_S = 10.0

Stop = Literal["disconnect", "drain"]


class OpenStreams:
    """The open SSE responses of this process, so a drain can end those still open at its deadline."""

    def __init__(self) -> None:
        self._cuts: set[Callable[[], None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        #: the drain deadline has passed: a stream that opens now ends at once
        self.expired = False

    def __len__(self) -> int:
        return len(self._cuts)

    def add(self, cut: Callable[[], None]) -> None:
        self._cuts.add(cut)

    def discard(self, cut: Callable[[], None]) -> None:
        self._cuts.discard(cut)

    def cut_at(self, deadline: float) -> None:
        """At ``deadline`` (``time.monotonic()``), end every stream still open."""
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._cut_all)

    def _cut_all(self) -> None:
        self.expired = True
        for cut in list(self._cuts):
            cut()


class SSEResponse(Response):
    """A Starlette ``Response`` only so frameworks pass it through untouched."""

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
        keepalive_s: float = 15.0,
        streams: OpenStreams | None = None,
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
        # Starlette's ``headers`` is a mutable view of ``raw_headers``: what is sent is what it shows.
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in raw.items()]
        self.status_code = 200
        self.background = None
        self._streams = streams
        # Per-response state, set when the response is served (a response is served once).
        self._task: asyncio.Task[Any] | None = None
        self._send: Send | None = None
        self._lock = asyncio.Lock()
        self._stop: Stop | None = None
        self._pumping = False
        self._sent = 0
        self._sent_at_tick = -1
        self._tick: asyncio.TimerHandle | None = None
        self._keepalive_task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task()
        assert task is not None
        self._send = send
        watcher = loop.create_task(self._watch(receive))
        self._tick = loop.call_later(self._keepalive_s, self._on_tick)
        streams = self._streams
        if streams is not None:
            streams.add(self._cut)
        try:
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                if streams is not None and streams.expired:
                    self._stop = "drain"
                if self._stop is None:
                    self._pumping = True
                    try:
                        await self._pump(send)
                    finally:
                        self._pumping = False
            except asyncio.CancelledError:
                if self._stop is None:
                    raise  # cancelled from outside (the server is stopping): not ours to absorb
                task.uncancel()
            if self._stop == "drain":
                shutting_down = Overloaded(
                    "the gateway is shutting down; retry the request", code="shutting_down"
                )
                async with self._lock:
                    await send(
                        {"type": "http.response.body", "body": error_frame(shutting_down), "more_body": False}
                    )
        except OSError:
            log.info("client_gone_during_send")
        finally:
            watcher.cancel()
            self._tick.cancel()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()
            if streams is not None:
                streams.discard(self._cut)
            await self._close(task)

    async def _pump(self, send: Send) -> None:
        lock = self._lock
        async for frame in self._frames:
            async with lock:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            self._sent += 1
        async with lock:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self, task: asyncio.Task[Any]) -> None:
        """Run ``on_close`` to the end (bounded), even when the request's task is being cancelled."""
        try:
            if task.cancelling():
                # A second cancellation must not cut the upstream's release short.
                cleanup = asyncio.ensure_future(self._on_close())
                await asyncio.wait_for(asyncio.shield(cleanup), _CLEANUP_TIMEOUT_S)
            else:
                async with asyncio.timeout(_CLEANUP_TIMEOUT_S):
                    await self._on_close()
        except TimeoutError:
            log.warning("stream_cleanup_timeout", timeout_s=_CLEANUP_TIMEOUT_S)

    def _interrupt(self, why: Stop) -> None:
        if self._stop is not None:
            return
        self._stop = why
        if self._pumping and self._task is not None:
            self._task.cancel()

    def _cut(self) -> None:
        self._interrupt("drain")

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._interrupt("disconnect")
                return

    def _on_tick(self) -> None:
        """Every ``keepalive_s``: a comment frame if nothing was sent since the last tick."""
        if self._sent == self._sent_at_tick and self._pumping and self._keepalive_task is None:
            self._keepalive_task = asyncio.get_running_loop().create_task(self._keepalive())
        self._sent_at_tick = self._sent
        self._tick = asyncio.get_running_loop().call_later(self._keepalive_s, self._on_tick)

    async def _keepalive(self) -> None:
        assert self._send is not None
        try:
            async with self._lock:
                await self._send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
        except OSError:
            pass  # the client is gone; the watcher ends the stream
        finally:
            self._keepalive_task = None
