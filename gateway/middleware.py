"""Pure ASGI middleware: a request id made by the gateway for every request, bound into the log context.

The id is never taken from the client, so a tenant cannot make its records look like
another request's. An id the client sends (``x-client-request-id``, as OpenAI's API
takes it, or ``x-request-id``) is kept beside it as ``client_request_id``, reduced to
safe characters and 64 of them, and echoed as ``x-client-request-id``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
