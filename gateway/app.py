"""The application factory: ``create_app(settings)``; no module-level app or settings."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import InvalidRequest, OmnigateError
from gateway import heap
from gateway.api import admin, admin_audit, admin_routing, admin_state, admin_tenants, chat, ops, realtime
from gateway.api import audio as audio_routes
from gateway.api import audio_openapi as audio_docs
from gateway.console import routes as console
from gateway.middleware import BodyDeadlineMiddleware, RequestIdMiddleware
from gateway.readiness import Readiness, ReadinessGate
from gateway.services import Services
from gateway.settings import Settings
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

_STATUS_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "payload_too_large"),
}


def error_response(exc: OmnigateError) -> JSONResponse:
    headers = exc.headers()
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"  # RFC 9110: a 401 names the scheme it wants
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def render_exception(exc: Exception) -> Response:
    """The one answer for an exception that ended a request before its response started."""
    if isinstance(exc, OmnigateError):
        return error_response(exc)
    if isinstance(exc, RequestValidationError):
        return error_response(chat.validation_to_error(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        etype, code = _STATUS_TYPES.get(exc.status_code, ("invalid_request_error", None))
        err = OmnigateError(str(exc.detail), status=exc.status_code, code=code)
        err.type = etype
        return error_response(err)
    if isinstance(exc, chat.ClientGone):
        return Response(status_code=499)  # nobody reads it; the status is for access logs
    log.error("unhandled_error", exc_info=exc)
    return error_response(OmnigateError("internal error; see the gateway log for this request id"))


_ANSWERED = (OmnigateError, RequestValidationError, StarletteHTTPException, chat.ClientGone)


class _Answered:
    """An ASGI app's errors answered by :func:`render_exception` while its response has not started;
    after that, the exception goes on to the server (the status is sent, the stream ends)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            await render_exception(exc)(scope, receive, send)
            if not isinstance(exc, _ANSWERED):
                raise  # as Starlette's server-error middleware: answered with a 500, and on to the server's log
            # Answered: its traceback goes (as Starlette's exception handling lets it go), so the frames it
            # holds, and the request's media in them, are not kept by a cycle until the next collection.
            exc.__traceback__ = None


class Gateway(FastAPI):
    """The FastAPI app, with the data plane's one route served beside it.

    ``POST /v1/chat/completions`` goes from the server straight to the route's ASGI app through the
    gateway's own middlewares (request id, body deadline, readiness) and one error boundary, not through
    FastAPI's and Starlette's stack (exception, body-limit and exit-stack middlewares, the router): the
    request line crosses as few layers as it can. Everything else, the chat route's other methods
    included, is FastAPI's.
    """

    data_plane: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.data_plane is not None
            and scope["type"] == "http"
            and scope["path"] == chat.PATH
            and scope["method"] == "POST"
        ):
            scope["app"] = self
            await self.data_plane(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _on_sighup(services: Services, config_path: str | Path | None) -> bool:
    """Reload the config on SIGHUP (only in the main thread, where signal handlers can be set)."""
    if config_path is None or threading.current_thread() is not threading.main_thread():
        return False
    from gateway.reload import reload_config

    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[object]] = set()

    def _reload() -> None:
        task = loop.create_task(reload_config(services, config_path, by={"credential": "signal:SIGHUP"}))
        pending.add(task)
        task.add_done_callback(pending.discard)

    loop.add_signal_handler(signal.SIGHUP, _reload)
    return True


def create_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    plugins: dict[str, type] | None = None,
    config_path: str | Path | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """``config_path`` is the file a reload (SIGHUP, ``POST /admin/config/reload``) reads again.

    ``freeze_heap`` (the server process sets it; see gateway/heap.py) freezes what is alive
    once startup is done, so garbage collections during requests stay short.
    """
    metrics = Metrics(registry)
    services = Services.build(settings, metrics, plugins)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hup = False
        try:
            # A start that fails part-way has closed what it started: aclose then finds nothing to close.
            await services.start()
            if freeze_heap:
                heap.freeze()
            hup = _on_sighup(services, config_path)
            yield
        finally:
            app.state.readiness.cancel()
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await services.aclose()

    app = Gateway(title="omnigate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.services = services
    app.state.config_path = config_path
    app.state.readiness = Readiness(services.pool)  # the server announces "ready" through it
    app.router.routes.extend(chat.routes)
    app.router.routes.extend(realtime.routes)  # WS /v1/realtime (OpenAI's Realtime protocol)
    app.router.routes.extend(audio_routes.routes)  # POST /v1/audio/transcriptions, /v1/audio/speech
    app.include_router(ops.router)
    app.include_router(admin.router)
    app.include_router(admin_tenants.router)
    app.include_router(admin_routing.router)
    app.include_router(admin_audit.router)
    app.include_router(admin_state.router)
    app.include_router(console.router)

    for kind in (*_ANSWERED, Exception):
        app.add_exception_handler(kind, _handler)

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()  # FastAPI keeps it as app.openapi_schema
            schema["paths"] = {**chat.OPENAPI_PATHS, **schema.get("paths", {})}
            schema.setdefault("components", {}).setdefault("schemas", {}).update(chat.OPENAPI_COMPONENTS)
            schema["paths"].update(audio_docs.OPENAPI_PATHS)
            schema["components"]["schemas"].update(audio_docs.OPENAPI_COMPONENTS)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(ReadinessGate, readiness=app.state.readiness, render=error_response)
    # Inside the request id's: a 408 for a body that did not come carries the request's id too.
    app.add_middleware(BodyDeadlineMiddleware, timeout_s=settings.server.body_timeout_s)
    app.add_middleware(RequestIdMiddleware)
    # The same middlewares, in the same order, around the chat route's data plane (see Gateway).
    app.data_plane = RequestIdMiddleware(
        BodyDeadlineMiddleware(
            ReadinessGate(
                _Answered(chat.ChatCompletions()), readiness=app.state.readiness, render=error_response
            ),
            timeout_s=settings.server.body_timeout_s,
        )
    )
    return app


async def _handler(request: Request, exc: Exception) -> Response:
    return render_exception(exc)


__all__ = ["InvalidRequest", "create_app"]
