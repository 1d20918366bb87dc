"""Models, liveness, readiness and metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.api.auth import authenticate
from gateway.context import RequestContext
from gateway.services import Services

router = APIRouter()
_STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    services: Services = request.app.state.services
    ctx = RequestContext(request_id=request.scope["state"]["request_id"])
    principal = authenticate(request, ctx)
    models = services.pool.models()
    if principal is not None and principal.tenant.models is not None:
        models = [m for m in models if m in principal.tenant.models]
    data = [{"id": m, "object": "model", "created": _STARTED, "owned_by": "omnigate"} for m in models]
    return JSONResponse({"object": "list", "data": data})


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    services: Services = request.app.state.services
    engines = services.pool.health_report()
    draining = services.draining.is_set()
    ready = services.pool.ready and not draining
    status = "draining" if draining else "ready" if ready else "not_ready"
    return JSONResponse(
        {
            "status": status,
            "engines": engines,
            "policies": services.chain.describe(),
            "grounding_scorer": services.describe_scorer(),
        },
        status_code=200 if ready else 503,
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    services: Services = request.app.state.services
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
