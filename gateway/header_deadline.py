"""uvicorn's HTTP protocols with a deadline on the request head, for ``omnigate serve``.

uvicorn bounds an idle kept-alive connection but not the time a client takes to send a request line
and headers: a connection that sends half a head and stops (or a byte now and then) stays open for
good, and a few hundred of them hold the server. Where no proxy stands in front (the Helm chart),
the gateway's own server must bound it, as a proxy's header timeout would. The deadline starts when
a connection opens and again at a request's first byte, and is not moved by more bytes; once the
head is complete it is cleared (the body has its own deadline, ``server.body_timeout_s``). When it
passes, the connection is closed.

The head's size is bounded too (``server.max_header_bytes``): h11 holds an incomplete head in one
buffer it caps, but httptools has no cap, and a client could send megabytes of headers for the
parser to keep. A head that grows past the cap is answered 431 in OpenAI's error shape and the
connection is closed, before more of it is parsed.
"""

from __future__ import annotations

import asyncio
import importlib.util

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from core.errors import InvalidRequest

#: what ``server.max_header_bytes`` defaults to
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


def _too_large(limit: int, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole 431 answer, to write to the transport before closing it."""
    error = InvalidRequest(
        f"the request head is larger than {limit} bytes", code="request_header_fields_too_large"
    )
    body = orjson.dumps(error.to_dict())
    head = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


def _head_part(before: bytes, data: bytes) -> int:
    """How many bytes of ``data`` belong to a head that ``before`` (what came of it so far) began: up to
    its blank line, which may straddle the two, or all of them."""
    if before:
        seam = (before[-3:] + data[:3]).find(b"\r\n\r\n")
        if seam >= 0:
            return seam + 4 - len(before[-3:])
    end = data.find(b"\r\n\r\n")
    return len(data) if end < 0 else end + 4


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the parser stops, and the protocol answers 431."""


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
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    _deadline: _Deadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # h11 caps the incomplete head it buffers; the cap is the gateway's setting, not uvicorn's.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header_bytes)
        self._deadline = _Deadline(self.loop, self.head_timeout_s, transport)
        self._deadline.arm()

    def data_received(self, data: bytes) -> None:
        # h11 caps only a head that is still incomplete once parsed: one that arrives whole in a read
        # is taken at any size. While the head is outstanding (nothing of the request parsed yet, so
        # whatever h11 holds is head) its bytes are counted up to its end before h11 sees them.
        if self.conn.their_state is h11.IDLE:
            held = self.conn.trailing_data[0]
            if len(held) + _head_part(held, data) > self.max_header_bytes:
                self._deadline.clear()
                if not self.transport.is_closing():
                    self.transport.write(_too_large(self.max_header_bytes, self.server_state.default_headers))
                    self.transport.close()
                return
        super().data_received(data)

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
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
        _deadline: _Deadline
        #: the head is outstanding (from the connection's start or the last message's end, to its headers' end)
        _in_head: bool
        #: bytes received while the head was outstanding, and the head's parsed size (URL and headers)
        _head_bytes: int
        _parsed_bytes: int
        _tail: bytes  # the last bytes counted: a head's blank line may straddle two reads
        _refused: bool

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._in_head, self._head_bytes, self._parsed_bytes, self._refused = True, 0, 0, False
            self._tail = b""
            self._deadline = _Deadline(self.loop, self.head_timeout_s, transport)
            self._deadline.arm()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                # Counted before the parser sees the bytes: httptools keeps a header's pieces until
                # the header is whole, so a header of megabytes would be held before any callback.
                # Where the head ends in this piece, only its part is counted (a body may follow).
                if self._head_bytes + _head_part(self._tail, data) > self.max_header_bytes:
                    self._refuse()
                    return
                self._head_bytes += len(data)
                self._tail = (self._tail + data[-3:])[-3:]
            super().data_received(data)

        def on_message_begin(self) -> None:
            self._parsed_bytes = 0
            self._deadline.arm()
            super().on_message_begin()

        def on_message_complete(self) -> None:
            # What comes next on the connection is the next request's head, counted from its first read.
            self._in_head, self._head_bytes, self._tail = True, 0, b""
            super().on_message_complete()

        # A message that begins inside a read whose start was another's (a pipelined one) is measured as
        # it is parsed too: its URL and headers, each as the parser hands it on.
        def on_url(self, url: bytes) -> None:
            self._parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._deadline.clear()
            super().on_headers_complete()

        def _parsed(self, size: int) -> None:
            self._parsed_bytes += size
            if self._parsed_bytes > self.max_header_bytes:
                self._refused = True
                raise _HeadTooLarge  # the parser stops; uvicorn answers through send_400_response

        def send_400_response(self, msg: str) -> None:
            if self._refused:
                self._refuse()
                return
            super().send_400_response(msg)

        def _refuse(self) -> None:
            self._in_head = False
            self._deadline.clear()
            if not self.transport.is_closing():
                self.transport.write(_too_large(self.max_header_bytes, self.server_state.default_headers))
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.clear()
            super().connection_lost(exc)

    return HttpToolsWithHeadDeadline


def protocol_class(
    head_timeout_s: float, http: str = "auto", *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> type[asyncio.Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``): ``http`` as uvicorn names it (``auto``
    takes httptools where it is installed, as uvicorn does), with ``head_timeout_s`` for the head and
    ``max_header_bytes`` for its size."""
    base: type[asyncio.Protocol] | None = None
    if http in ("auto", "httptools"):
        base = _httptools_class()
        if base is None and http == "httptools":
            raise RuntimeError("http 'httptools' asked for, but httptools is not installed")
    if base is None:
        base = H11WithHeadDeadline
    return type(
        base.__name__, (base,), {"head_timeout_s": head_timeout_s, "max_header_bytes": max_header_bytes}
    )
