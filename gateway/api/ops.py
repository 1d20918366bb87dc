"""Models, liveness, readiness and metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.services import Services

router = APIRouter()
_STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    services: Services = request.app.state.services
    data = [{"id": m, "object": "model", "created": _STARTED, "owned_by": "omnigate"} for m in services.pool.models()]
    return JSONResponse({"object": "list", "data": data})


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    services: Services = request.app.state.services
    engines = services.pool.health_report()
    ready = services.pool.ready
    return JSONResponse(
        {
            "status": "ready" if ready else "not_ready",
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
