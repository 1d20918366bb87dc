"""Models, liveness, readiness and metrics."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.exposition import choose_encoder
from starlette.responses import JSONResponse, Response

from core.context import RequestContext
from core.errors import ModelNotFound, NotFound
from gateway.api.admin import admin_credential
from gateway.api.auth import authenticate
from gateway.services import Services

router = APIRouter()
_STARTED = int(time.time())


async def _visible_models(request: Request) -> list[str]:
    """The public models the caller may use: every served one, or its tenant's share of them."""
    services: Services = request.app.state.services
    ctx = RequestContext.new(request.scope["state"]["request_id"])
    principal = await authenticate(request, ctx)
    models = services.pool.models()
    if principal is not None and principal.tenant.models is not None:
        models = [m for m in models if m in principal.tenant.models]
    return models


def _model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": _STARTED, "owned_by": "omnigate"}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model(m) for m in await _visible_models(request)]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    """OpenAI's ``models.retrieve``; a model the caller may not use is as absent as one nobody serves."""
    if model_id not in await _visible_models(request):
        raise ModelNotFound(
            f"The model {model_id!r} does not exist or you do not have access to it.", param="model"
        )
    return JSONResponse(_model(model_id))


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Status for anyone (a load balancer's probe); engine names, the chain and auth detail to the admin only.

    Not ready (503) while draining, while no engine can serve, and while admission cannot take a slot
    for a request of the default class (``reason: admission_full``)."""
    services: Services = request.app.state.services
    draining = services.draining.is_set()
    ready = services.pool.ready and not draining
    status = "draining" if draining else "ready" if ready else "not_ready"
    body: dict[str, Any] = {"status": status}
    if ready and services.admission is not None and await services.admission.full():
        # Up, but every slot a request of the default class could take is held: it would get a 503.
        ready = False
        body = {"status": "not_ready", "reason": "admission_full"}
    settings = services.settings
    if (
        settings.admin.enabled
        and admin_credential(settings, request.headers.get("authorization")) is not None
    ):
        body.update(
            {
                "engines": services.pool.health_report(),
                "engine_problems": services.pool.mismatches(),
                "policies": services.chain.describe(),
                "grounding_scorer": services.describe_scorer(),
                "auth": services.describe_auth(),
                # what the kernel granted the decoding workers (None until they have started)
                "media_sandbox": services.media.sandbox.confinement if services.media is not None else None,
            }
        )
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    services: Services = request.app.state.services
    if services.settings.metrics.port is not None:
        # Served on the metrics port only (see gateway/metrics_server.py); here it does not exist.
        raise NotFound("Not Found")
    # OpenMetrics when the scraper asks for it (Prometheus does): only that format carries exemplars.
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(services.metrics.registry), media_type=content_type)
