"""Pure ASGI middleware: a request id for every request, bound into the log context."""

from __future__ import annotations

import re
import uuid

import structlog

_SAFE_ID = re.compile(rb"^[A-Za-z0-9._-]{1,64}$")


class RequestIdMiddleware:
    def __init__(self, app) -> None:  # noqa: ANN001
        self.app = app

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for key, value in scope.get("headers", ()):
            if key == b"x-request-id" and _SAFE_ID.match(value):
                rid = value.decode()
                break
        if rid is None:
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message) -> None:  # noqa: ANN001
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], header]
            await send(message)

        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            structlog.contextvars.clear_contextvars()
