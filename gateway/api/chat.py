"""``POST /v1/chat/completions``: parse, call the pipeline, render. Nothing else.

The endpoint is a plain Starlette route: it reads and validates its own body (one
size cap, one error shape) and uses no dependency injection, and FastAPI's
per-request route machinery would add tens of microseconds to every call's path to
the first token. Its OpenAPI operation is declared here (``OPENAPI_PATHS``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import orjson
import structlog
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.context import RequestContext
from core.errors import InvalidRequest, OmnigateError, PayloadTooLarge, RequestTimeout
from core.schemas import ChatCompletionRequest
from gateway.api import body as json_body
from gateway.api.auth import authenticate
from gateway.auth_failures import TooManyAuthFailures
from gateway.fields import DROPPED_HEADER, UnknownFields, parse_request
from gateway.pipeline import ResponseStream
from gateway.render import ChunkRenderer, completion_body, error_frame
from gateway.services import Services
from gateway.sse import SSEResponse
from gateway.tenants import KeyRefused

log = structlog.get_logger(__name__)
T = TypeVar("T")

# The body is parsed by hand, so its schema is declared here; the nested models go to
# the document's components (see ``app.openapi``).
_BODY_SCHEMA = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
OPENAPI_COMPONENTS: dict[str, Any] = _BODY_SCHEMA.pop("$defs", {})
OPENAPI_COMPONENTS["ChatCompletionRequest"] = _BODY_SCHEMA
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/chat/completions": {
        "post": {
            "summary": "Chat Completions",
            "operationId": "chat_completions_v1_chat_completions_post",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}
                },
            },
            "responses": {
                "200": {
                    "description": "A chat completion; with `stream: true`, its chunks as server-sent events",
                    "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {}}},
                },
                "4XX": {
                    "description": 'An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`',
                    "content": {"application/json": {"schema": {}}},
                },
            },
        }
    }
}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "body"})


def _is_tag(part: str) -> bool:
    # pydantic names union branches in error locations ('str', 'list[...]', 'TextPart', ...).
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def validation_to_error(errors: Sequence[Any]) -> InvalidRequest:
    """The most specific validation error as an OpenAI ``invalid_request_error`` naming the field."""
    if not errors:
        return InvalidRequest("invalid request body")
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    param = ".".join(str(x) for x in best.get("loc", ()) if not _is_tag(str(x))) or None
    msg = best.get("msg", "invalid value")
    return InvalidRequest(f"{param}: {msg}" if param else msg, param=param)


async def _read_body(request: Request, limit: int, timeout_s: float) -> json_body.Reader:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    # Fed to a reader as it comes: its long base64 payloads are decoded into the spool as they arrive
    # (gateway/api/body.py), the rest grows one buffer (never sized from Content-Length: a client could
    # make every connection reserve the limit).
    media = request.app.state.services.media
    # Spooled payloads count against the media budget as they are written (a 503 mid-body past it).
    body = json_body.Reader(budget=media.spool_budget() if media is not None else None)
    try:
        # A client trickling its body (slowloris) holds a connection; bound the whole read.
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if body.size + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                body.feed(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    return body


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
        ctx.outputs.response_headers[DROPPED_HEADER] = ",".join(dropped)
        log.info("request_fields_dropped", fields=dropped)
    return chat


def _headers(ctx: RequestContext) -> dict[str, str]:
    headers = dict(ctx.outputs.response_headers)
    if ctx.outputs.degraded:
        headers["x-omnigate-degraded"] = ",".join(ctx.outputs.degraded)
    return headers


async def chat_completions(request: Request) -> Response:
    services: Services = request.app.state.services
    ctx = RequestContext.new(
        request.scope["state"]["request_id"],
        client_request_id=request.scope["state"].get("client_request_id"),
        requested_priority=request.headers.get(services.settings.traffic.priority_header),
    )
    try:
        await authenticate(request, ctx)
    except (KeyRefused, TooManyAuthFailures):
        # Counted and audited in aggregate (gateway/auth_failures.py), never one record each.
        raise
    except OmnigateError as exc:
        await services.pipeline.refused(ctx, exc)
        raise
    try:
        await services.pipeline.admit(ctx)  # before the body: a refused request costs no read, no media
        server = services.settings.server
        body = await _read_body(request, server.max_body_bytes, server.body_timeout_s)
        ctx.record.body_bytes = body.size
        chat = _parse_for(body, ctx, services)  # empties the body
        del body
    except OmnigateError as exc:
        await services.pipeline.refused(ctx, exc)
        raise
    completion_id = "chatcmpl-" + uuid.uuid4().hex
    # The pipeline owns the request from here: its media steps replace the client's parts, and a
    # reference kept in this frame would hold the client's base64 until the response is done.
    if not chat.stream:
        completing = services.pipeline.complete(chat, ctx)
        del chat
        result = await _unless_client_leaves(request, completing)
        content = completion_body(result.request, result.completion, ctx, completion_id)
        return Response(orjson.dumps(content), media_type="application/json", headers=_headers(ctx))
    opening = services.pipeline.stream(chat, ctx)
    del chat
    # Returns once the first chunk is released: a held-back answer can still be refused with a status.
    stream = await _unless_client_leaves(request, opening)
    renderer = ChunkRenderer(stream.request, ctx, completion_id)
    return SSEResponse(
        _frames(stream, renderer),
        on_close=stream.aclose,
        headers=_headers(ctx),
        keepalive_s=services.settings.server.sse_keepalive_s,
        streams=services.streams,
    )


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"], name="chat_completions")]


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
    try:
        async for delta in stream.deltas():
            frame = renderer.render(delta)
            if frame:
                yield frame
        yield renderer.final()
    except OmnigateError as exc:
        yield error_frame(exc)
    except Exception as exc:
        log.error("stream_failed", exc_info=exc)
        yield error_frame(OmnigateError("internal error; see the gateway log for this request id"))


__all__ = ["JSONResponse", "routes", "validation_to_error"]
