"""The admin API: a router of its own under ``/admin``, never in the public schema.

Every route depends on :func:`require_admin`. With no ``admin.api_key`` configured
the whole surface answers 404, as if it did not exist. With the console on, a
console session cookie is accepted in place of the Bearer key (gateway/console/session.py).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

from gateway.console import session as console_session
from gateway.errors import AuthenticationFailed, OmnigateError
from gateway.services import Services


class AdminDisabled(OmnigateError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


async def require_admin(request: Request) -> None:
    services: Services = request.app.state.services
    key = services.settings.admin.api_key
    if key is None:
        raise AdminDisabled("Not Found")
    header = request.headers.get("authorization", "")
    # The console's browser calls carry its session cookie instead (and a CSRF token on changes).
    console = not header and services.settings.admin.console.enabled
    if console and console_session.from_request(request, key.get_secret_value()) is not None:
        request.state.admin_credential = "console-session"
        return
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise AuthenticationFailed("invalid admin key")


router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_admin)])


@router.get("/engines")
async def engines(request: Request) -> JSONResponse:
    """Each engine's configuration (no secrets) and current health."""
    services: Services = request.app.state.services
    health = services.pool.health_report()
    return JSONResponse({
        "engines": [
            {"name": e.name, "kind": e.kind, "variant": e.variant, "role": e.role, "serves": e.serves,
             "model": e.model, "healthy": health.get(e.name, False)}
            for e in services.settings.engines
        ],
        "policies": services.chain.describe(),
    })
