"""A pure ASGI Server-Sent Events response that is pulled, bounded and always cleaned up.

The frame iterator advances only after ``send`` returns (backpressure). The
frames are pumped in the request's own task; one watcher task waits for
``http.disconnect`` and, when the client leaves, cancels the pump, after which
``on_close`` closes the upstream request. Idle streams get keep-alive comments
from a loop timer. When the gateway drains for shutdown, a stream still open at
the drain deadline (see :class:`OpenStreams`) ends with an error frame and
``[DONE]`` instead of being cut off.

Every write has a deadline: a client that stops reading makes the server's
buffers fill and ``send`` wait. A loop timer (never a timeout around each send:
the pump's per-frame work stays two attribute writes) checks that a write in
progress keeps making progress; one that has made none for ``write_timeout_s``
stops the stream (``on_stop("stalled")``, then the pump is cancelled and
``on_close`` runs as for a disconnect).

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

#: why a stream ended before its last frame: the client left, the gateway drained, the client stopped reading
Stop = Literal["disconnect", "drain", "stalled"]


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
        on_stop: Callable[[Stop], None] | None = None,
        headers: dict[str, str] | None = None,
        keepalive_s: float = 15.0,
        write_timeout_s: float = 20.0,
        streams: OpenStreams | None = None,
    ) -> None:
        self._frames = frames
        self._on_close = on_close
        self._on_stop = on_stop
        self._keepalive_s = keepalive_s
        self._write_timeout_s = write_timeout_s
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
        # The write deadline: a write is in progress, writes completed, and how long none has completed.
        self._writing = False
        self._writes = 0
        self._writes_at_check = -1
        self._stalled_s = 0.0
        self._check: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task()
        assert task is not None
        self._send = send
        watcher = loop.create_task(self._watch(receive))
        self._tick = loop.call_later(self._keepalive_s, self._on_tick)
        self._check = loop.call_later(self._write_timeout_s / 4, self._on_check)
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
                try:
                    async with self._lock, asyncio.timeout(self._write_timeout_s):
                        await send(
                            {
                                "type": "http.response.body",
                                "body": error_frame(shutting_down),
                                "more_body": False,
                            }
                        )
                except TimeoutError:
                    log.info("client_stalled", at="drain")
        except OSError:
            log.info("client_gone_during_send")
        finally:
            watcher.cancel()
            self._tick.cancel()
            self._check.cancel()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()
            if streams is not None:
                streams.discard(self._cut)
            await self._close(task)

    async def _pump(self, send: Send) -> None:
        lock = self._lock
        async for frame in self._frames:
            async with lock:
                self._writing = True
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                self._writing = False
                self._writes += 1
            self._sent += 1
        async with lock:
            self._writing = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._writing = False

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
        if self._on_stop is not None:
            self._on_stop(why)
        if self._pumping and self._task is not None:
            self._task.cancel()
        if why == "stalled" and self._keepalive_task is not None:
            self._keepalive_task.cancel()  # it may be the write that is stuck

    def _cut(self) -> None:
        self._interrupt("drain")

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._interrupt("disconnect")
                return

    def _on_check(self) -> None:
        """Every quarter of ``write_timeout_s``: stop the stream if a write has been stuck for all of it."""
        period = self._write_timeout_s / 4
        if self._writing and self._writes == self._writes_at_check:
            self._stalled_s += period
        else:
            self._stalled_s = 0.0
        self._writes_at_check = self._writes
        if self._stalled_s >= self._write_timeout_s:
            log.warning("client_stalled", timeout_s=self._write_timeout_s, frames_sent=self._sent)
            self._interrupt("stalled")
            return
        self._check = asyncio.get_running_loop().call_later(period, self._on_check)

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
                self._writing = True
                await self._send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                self._writing = False
                self._writes += 1
        except OSError:
            pass  # the client is gone; the watcher ends the stream
        finally:
            self._keepalive_task = None
