"""uvicorn's HTTP protocols with a deadline on the request head, for ``omnigate serve``.

uvicorn bounds an idle kept-alive connection but not the time a client takes to send a request line
and headers: a connection that sends half a head and stops (or a byte now and then) stays open for
good, and a few hundred of them hold the server. Where no proxy stands in front (the Helm chart),
the gateway's own server must bound it, as a proxy's header timeout would. The deadline starts when
a connection opens and again at a request's first byte, and is not moved by more bytes; once the
head is complete it is cleared (the body has its own deadline, ``server.body_timeout_s``). When it
passes, the connection is closed.
"""

from __future__ import annotations

import asyncio
import importlib.util

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _Deadline:
    """One connection's head deadline: armed once until cleared, closing the transport when it passes."""

    __slots__ = ("_handle", "_loop", "_seconds", "_transport")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, transport: asyncio.BaseTransport
    ) -> None:
        self._loop, self._seconds, self._transport = loop, seconds, transport
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self._handle is None:  # a byte that arrives later does not move it (slowloris)
            self._handle = self._loop.call_later(self._seconds, self._passed)

    def clear(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _passed(self) -> None:
        self._handle = None
        if not self._transport.is_closing():
            self._transport.close()


class H11WithHeadDeadline(H11Protocol):
    """h11's protocol: the head is outstanding while the client's side of the cycle is ``IDLE``."""

    head_timeout_s: float = 10.0
    _deadline: _Deadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = _Deadline(self.loop, self.head_timeout_s, transport)
        self._deadline.arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is h11.IDLE:
            self._deadline.arm()
        else:
            self._deadline.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.clear()
        super().connection_lost(exc)


def _httptools_class() -> type[asyncio.Protocol] | None:
    if importlib.util.find_spec("httptools") is None:
        return None
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsWithHeadDeadline(HttpToolsProtocol):
        """httptools' protocol: the parser says when a message begins and when its head is complete."""

        head_timeout_s: float = 10.0
        _deadline: _Deadline

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline = _Deadline(self.loop, self.head_timeout_s, transport)
            self._deadline.arm()

        def on_message_begin(self) -> None:
            self._deadline.arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._deadline.clear()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.clear()
            super().connection_lost(exc)

    return HttpToolsWithHeadDeadline


def protocol_class(head_timeout_s: float, http: str = "auto") -> type[asyncio.Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``): ``http`` as uvicorn names it (``auto``
    takes httptools where it is installed, as uvicorn does), with ``head_timeout_s`` for the head."""
    base: type[asyncio.Protocol] | None = None
    if http in ("auto", "httptools"):
        base = _httptools_class()
        if base is None and http == "httptools":
            raise RuntimeError("http 'httptools' asked for, but httptools is not installed")
    if base is None:
        base = H11WithHeadDeadline
    return type(base.__name__, (base,), {"head_timeout_s": head_timeout_s})
