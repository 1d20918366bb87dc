"""Pure ASGI middleware: a request id for every request, and a deadline on every request body.

The id is made by the gateway, never taken from the client, so a tenant cannot make its records look
like another request's. An id the client sends (``x-client-request-id``, as OpenAI's API takes it, or
``x-request-id``) is kept beside it as ``client_request_id``, reduced to safe characters and 64 of
them, and echoed as ``x-client-request-id``.

The body deadline (``server.body_timeout_s``) is the app's, not each route's, so no route that reads
a body can forget it: a client that stalls or trickles a body holds a connection and a task only
that long.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterable

import orjson
import structlog
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import RequestTimeout

_UNSAFE = re.compile(rb"[^A-Za-z0-9._:-]")
_CLIENT_HEADERS = (b"x-client-request-id", b"x-request-id")


def client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The client's own id, sanitised (None when absent or nothing safe is left of it)."""
    found: dict[bytes, bytes] = {}
    for key, value in headers:
        if key in _CLIENT_HEADERS and key not in found:
            found[key] = value
    for name in _CLIENT_HEADERS:
        if name in found:
            cleaned = _UNSAFE.sub(b"", found[name][:256])[:64]
            return cleaned.decode() or None
    return None


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex
        client_rid = client_request_id(scope.get("headers", ()))
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["client_request_id"] = client_rid
        added = [(b"x-request-id", rid.encode())]
        if client_rid is not None:
            added.append((b"x-client-request-id", client_rid.encode()))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *added]
            await send(message)

        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=rid)
        if client_rid is not None:
            structlog.contextvars.bind_contextvars(client_request_id=client_rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            structlog.contextvars.clear_contextvars()


class BodyDeadlineMiddleware:
    """The whole request body must arrive within ``timeout_s`` of the app's first read of it.

    The deadline is not moved by bytes that arrive (a trickle is no way around it). When it passes
    before the response has started, the client is answered 408 in OpenAI's error shape and the app
    is told the client has gone (``http.disconnect``), so the route ends and gives back what it holds;
    nothing it sends after that reaches the client. Every 408, this one or a route's own, closes the
    connection (RFC 9110, 15.5.9): the rest of a body that did not come is not waited for.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _TimedBody(receive, send, self.timeout_s)
        try:
            await self.app(scope, body.receive, body.send)
        except ClientDisconnect:
            if not body.answered:
                raise
            # The route read on and found the client gone, as it was told: the 408 was its answer.


class _TimedBody:
    """One request's ``receive`` under the body deadline, and its ``send``."""

    __slots__ = ("_answered", "_deadline", "_done", "_receive", "_send", "_started", "_timeout_s")

    def __init__(self, receive: Receive, send: Send, timeout_s: float) -> None:
        self._receive, self._send, self._timeout_s = receive, send, timeout_s
        self._deadline: float | None = None  # the loop's time by which the body must be complete
        self._done = False  # the body is complete (or the client left): receive is the server's again
        self._started = False
        self._answered = False  # the 408 went out: the app's own answer is dropped

    @property
    def answered(self) -> bool:
        return self._answered

    async def receive(self) -> Message:
        if self._answered:
            return {"type": "http.disconnect"}
        if self._done:
            return await self._receive()
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + self._timeout_s
        try:
            # A route's own deadline over the same read (the chat route's) started first, so it fires
            # first and the route answers itself; this one catches every route that has none.
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            await self._timed_out()
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._done = True
        return message

    async def send(self, message: Message) -> None:
        if self._answered:
            return
        if message["type"] == "http.response.start":
            self._started = True
            if message["status"] == 408:
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
        await self._send(message)

    async def _timed_out(self) -> None:
        if self._started:
            return  # too late for a status: the app ends on the disconnect, the server closes the stream
        self._answered = True
        error = RequestTimeout(f"the request body did not arrive within {self._timeout_s:g} s")
        content = orjson.dumps(error.to_dict())
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            (b"connection", b"close"),
        ]
        await self._send({"type": "http.response.start", "status": 408, "headers": headers})
        await self._send({"type": "http.response.body", "body": content})
