"""Who is calling: resolves the Bearer key to a tenant before anything else reads the request."""

from __future__ import annotations

import structlog
from fastapi import Request

from core.context import RequestContext
from gateway.services import Services
from gateway.tenants import KeyRefused, Principal


def client_address(request: Request) -> str:
    """The peer address (uvicorn already applied X-Forwarded-For from the proxies it trusts)."""
    return request.client.host if request.client is not None else "unknown"


async def authenticate(request: Request, ctx: RequestContext) -> Principal | None:
    """Bind the caller's tenant to ``ctx``; None only when the config turned authentication off.

    A refused key raises :class:`KeyRefused` (401); an address that failed too often gets 429
    (:class:`~gateway.auth_failures.TooManyAuthFailures`) on every attempt, right key or not, while blocked.
    """
    services: Services = request.app.state.services
    if not services.auth_required:
        return None
    # Before the key is looked at: a blocked address is refused whatever it sends (gateway/auth_failures.py).
    services.auth_failures.check(client_address(request))
    try:
        principal = services.directory.authenticate(request.headers.get("authorization"))
    except KeyRefused as exc:
        services.metrics.auth_failures.labels(exc.reason).inc()
        ctx.identity = ctx.identity.refused(exc.key_id)
        await services.auth_failures.failed(client_address(request), exc.reason)
        raise
    tenant = principal.tenant
    ctx.identity = ctx.identity.authenticated(tenant, principal.key_id)
    structlog.contextvars.bind_contextvars(tenant=tenant.name)
    return principal
