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

from core.errors import InvalidRequest, OmnigateError
from gateway import heap
from gateway.api import admin, admin_audit, admin_routing, admin_state, admin_tenants, chat, ops
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

    app = FastAPI(title="omnigate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.services = services
    app.state.config_path = config_path
    app.state.readiness = Readiness(services.pool)  # the server announces "ready" through it
    app.router.routes.extend(chat.routes)
    app.include_router(ops.router)
    app.include_router(admin.router)
    app.include_router(admin_tenants.router)
    app.include_router(admin_routing.router)
    app.include_router(admin_audit.router)
    app.include_router(admin_state.router)
    app.include_router(console.router)

    @app.exception_handler(OmnigateError)
    async def _omnigate_error(request: Request, exc: OmnigateError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(chat.validation_to_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        etype, code = _STATUS_TYPES.get(exc.status_code, ("invalid_request_error", None))
        err = OmnigateError(str(exc.detail), status=exc.status_code, code=code)
        err.type = etype
        return error_response(err)

    @app.exception_handler(chat.ClientGone)
    async def _client_gone(request: Request, exc: chat.ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the status is for access logs

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", exc_info=exc)
        return error_response(OmnigateError("internal error; see the gateway log for this request id"))

    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()  # FastAPI keeps it as app.openapi_schema
            schema["paths"] = {**chat.OPENAPI_PATHS, **schema.get("paths", {})}
            schema.setdefault("components", {}).setdefault("schemas", {}).update(chat.OPENAPI_COMPONENTS)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(ReadinessGate, readiness=app.state.readiness, render=error_response)
    # Inside the request id's: a 408 for a body that did not come carries the request's id too.
    app.add_middleware(BodyDeadlineMiddleware, timeout_s=settings.server.body_timeout_s)
    app.add_middleware(RequestIdMiddleware)
    return app


__all__ = ["InvalidRequest", "create_app"]
