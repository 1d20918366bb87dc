"""``POST /v1/chat/completions``: parse, call the pipeline, render. Nothing else.

The endpoint is a plain ASGI route: it reads and validates its own body (one
size cap, one error shape) and uses no dependency injection, and FastAPI's
per-request route machinery would add tens of microseconds to every call's path to
the first token. It is ASGI rather than a request-to-response function so that the
request's exit stack (``Pipeline.lifetime``) spans everything, the body read and the
response being sent: what the request holds is given back however it ends. Every
write to the client has a deadline (``server.stream_write_timeout_s``). Its OpenAPI
operation is declared in :mod:`gateway.api.chat_openapi` (``OPENAPI_PATHS``, re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import orjson
import structlog
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from core.context import RequestContext
from core.errors import (
    ClientClosedRequest,
    ClientStalled,
    InvalidRequest,
    OmnigateError,
    PayloadTooLarge,
    RequestTimeout,
)
from core.schemas import ChatCompletionRequest
from gateway.api import body as json_body
from gateway.api.auth import authenticate

# Re-exported: the app reads the route's OpenAPI operation, and the admin routes the error mapping, here.
from gateway.api.chat_openapi import OPENAPI_COMPONENTS as OPENAPI_COMPONENTS
from gateway.api.chat_openapi import OPENAPI_PATHS as OPENAPI_PATHS
from gateway.api.validation import validation_to_error
from gateway.auth_failures import TooManyAuthFailures
from gateway.fields import DROPPED_HEADER, UnknownFields, dropped_header, parse_request
from gateway.pipeline import ResponseStream
from gateway.render import ChunkRenderer, completion_body, error_frame, response_headers
from gateway.services import Services
from gateway.sse import SSEResponse, Stop
from gateway.tenants import KeyRefused
from policies.media.sandbox import RequestBudget

log = structlog.get_logger(__name__)
T = TypeVar("T")


async def _read_body(
    request: Request, limit: int, timeout_s: float, budget: RequestBudget | None = None
) -> json_body.Reader:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    # Fed to a reader as it comes: its long base64 payloads are decoded into the spool as they arrive
    # (gateway/api/body.py), the rest grows one buffer (never sized from Content-Length: a client could
    # make every connection reserve the limit).
    # Spooled payloads count against the request's media budget as they are written (a 503 mid-body
    # past the process's), given back with the rest of what the request holds when it ends.
    body = json_body.Reader(budget=budget)
    try:
        # A client trickling its body (slowloris) holds a connection; bound the whole read.
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if body.size + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                body.feed(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientClosedRequest("the client closed the connection before its request was read") from None
    return body


def _media_budget(ctx: RequestContext, services: Services) -> RequestBudget | None:
    """The request's media budget, opened before its body is read (its spool is counted in it)."""
    if services.media is None:
        return None
    budget = services.media.request_budget()
    ctx.media_budget = budget
    return budget


def _parse(
    body: bytes | bytearray | json_body.Reader,
    mode: UnknownFields = "refuse",
    dropped: list[str] | None = None,
) -> ChatCompletionRequest:
    """The request in ``body``; fields dropped under ``mode`` ``drop`` are appended to ``dropped``.

    A ``bytearray`` body (or a reader's) is emptied once parsed (gateway/api/body.py): the parsed
    strings are the request from then on, and a body carrying media would otherwise be held beside them.
    """
    try:
        if isinstance(body, json_body.Reader):
            doc = body.result()
        else:
            doc = json_body.loads(body) if isinstance(body, bytearray) else orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        chat, gone = parse_request(doc, mode)
    except ValidationError as exc:
        raise validation_to_error(exc.errors()) from None
    if dropped is not None:
        dropped.extend(gone)
    return chat


def _parse_for(body: json_body.Reader, ctx: RequestContext, services: Services) -> ChatCompletionRequest:
    tenant = ctx.identity.tenant_config
    mode = (
        tenant.unknown_fields if tenant is not None else None
    ) or services.settings.requests.unknown_fields
    dropped: list[str] = []
    chat = _parse(body, mode, dropped)
    if dropped:
        ctx.outputs.response_headers[DROPPED_HEADER] = dropped_header(dropped)
        log.info("request_fields_dropped", fields=dropped)
    return chat


class ChatCompletions:
    """The route's ASGI app (a class: Starlette serves a class as ASGI, a function as request-to-response)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        services: Services = request.app.state.services
        ctx = RequestContext.new(
            request.scope["state"]["request_id"],
            client_request_id=request.scope["state"].get("client_request_id"),
            requested_priority=request.headers.get(services.settings.traffic.priority_header),
        )
        with services.pipeline.traced(ctx, request.headers):
            try:
                await authenticate(request, ctx)
            except (KeyRefused, TooManyAuthFailures):
                # Counted and audited in aggregate (gateway/auth_failures.py), never one record each.
                raise
            except OmnigateError as exc:
                await services.pipeline.refused(ctx, exc)
                raise
            # What the request takes from here is given back when this closes, however the request ends.
            async with services.pipeline.lifetime(ctx) as stack:
                response = await _respond(request, ctx, services, stack)
                await response(scope, receive, send)


async def _respond(
    request: Request, ctx: RequestContext, services: Services, stack: contextlib.AsyncExitStack
) -> Response:
    server = services.settings.server
    await services.pipeline.admit(ctx)  # before the body: a refused request costs no read, no media
    body = await _read_body(
        request, server.max_body_bytes, server.body_timeout_s, _media_budget(ctx, services)
    )
    ctx.record.body_bytes = body.size
    chat = _parse_for(body, ctx, services)  # empties the body
    del body
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    # The pipeline owns the request from here: its media steps replace the client's parts, and a
    # reference kept in this frame would hold the client's base64 until the response is done.
    if not chat.stream:
        completing = services.pipeline.complete(chat, ctx)
        del chat
        result = await _unless_client_leaves(request, completing)
        content = completion_body(result.request, result.completion, ctx, completion_id)
        return JSONAnswer(orjson.dumps(content), response_headers(ctx), server.stream_write_timeout_s)
    opening = services.pipeline.stream(chat, ctx)
    del chat
    # Returns once the first chunk is released: a held-back answer can still be refused with a status.
    stream = await _unless_client_leaves(request, opening)
    stack.push_async_callback(stream.aclose)  # closed with the request, even if no response is made of it
    renderer = ChunkRenderer(stream.request, ctx, completion_id)

    def stopped(why: Stop) -> None:
        if why == "stalled":
            stream.cut(ClientStalled(f"the client read nothing for {server.stream_write_timeout_s:g} s"))

    return SSEResponse(
        _frames(stream, renderer),
        on_close=stream.aclose,
        on_stop=stopped,
        headers=response_headers(ctx),
        keepalive_s=server.sse_keepalive_s,
        write_timeout_s=server.stream_write_timeout_s,
        streams=services.streams,
    )


class JSONAnswer(Response):
    """A JSON answer written in pieces, each within the write deadline: a client that does not read it
    holds a piece or two of it in the server's buffers, not the whole answer, and not for ever."""

    media_type = "application/json"
    #: bytes per write; each must leave for the client within the deadline
    piece = 64 * 1024

    def __init__(self, content: bytes, headers: dict[str, str], write_timeout_s: float) -> None:
        super().__init__(content, headers=headers)
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, piece, deadline = self.body, self.piece, self._write_timeout_s
        at = 0
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        try:
            async with asyncio.timeout(deadline):
                await send(start)
            for at in range(0, len(body), piece):
                more = at + piece < len(body)
                async with asyncio.timeout(deadline):
                    await send(
                        {"type": "http.response.body", "body": body[at : at + piece], "more_body": more}
                    )
        except TimeoutError:
            # The answer was made and audited; the client stopped taking it. Cut, not an error to render.
            log.warning("client_stalled", written=at, size=len(body), timeout_s=deadline)


PATH = "/v1/chat/completions"
routes = [Route(PATH, ChatCompletions(), methods=["POST"], name="chat_completions")]


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` in this task, cancelling it (and so the engine call) if the client disconnects first.

    The body has been read, so the next ASGI message can only be ``http.disconnect``.
    ``work`` runs inline rather than in a task of its own: the first chunk goes out
    without another trip through the event loop.
    """
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        if (await request.receive())["type"] == "http.disconnect":
            left = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()


class ClientGone(Exception):
    """The client disconnected before the answer was ready; nobody is left to answer."""


async def _frames(stream: ResponseStream, renderer: ChunkRenderer) -> AsyncIterator[bytes]:
    """After the first byte the status is fixed: a failure becomes an error frame and [DONE]."""
    # A batch (what one read of the engine brought and the policies released) goes out in one write.
    batch: list[bytes] = []
    try:
        async for deltas in stream.batches():
            for delta in deltas:
                if frame := renderer.render(delta):
                    batch.append(frame)
            if batch:
                yield batch[0] if len(batch) == 1 else b"".join(batch)
                batch.clear()
        batch.append(renderer.final())
        yield b"".join(batch)
    except OmnigateError as exc:
        batch.append(error_frame(exc))
        yield b"".join(batch)
    except Exception as exc:
        log.error("stream_failed", exc_info=exc)
        batch.append(error_frame(OmnigateError("internal error; see the gateway log for this request id")))
        yield b"".join(batch)


__all__ = ["JSONResponse", "routes", "validation_to_error"]
