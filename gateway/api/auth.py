"""Who is calling: resolves the Bearer key to a tenant before anything else reads the request."""

from __future__ import annotations

import structlog
from fastapi import Request

from core.context import RequestContext
from gateway.services import Services
from gateway.tenants import KeyRefused, Principal

# OpenAI's words for a request that sent no key (type invalid_request_error, code null), so a client
# told "you sent none" looks at its configuration, not at its key; every other refusal, wrong, unknown
# or disabled, is the one "Incorrect API key provided" (nothing tells which keys exist).
_NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY). You can obtain an API key from the operator of "
    "this gateway."
)


def _no_key(exc: KeyRefused) -> None:
    """Give a refusal for a missing key OpenAI's message, type and code (still a KeyRefused: refusals are
    counted and audited in aggregate, never one record each)."""
    exc.message = _NO_KEY
    exc.args = (_NO_KEY,)
    exc.type = "invalid_request_error"
    # AuthenticationFailed declares its code as a str; OmnigateError's renderer takes None (JSON null).
    exc.code = None  # type: ignore[assignment]


def client_address(request: Request) -> str:
    """The peer address (uvicorn already applied X-Forwarded-For from the proxies it trusts)."""
    return request.client.host if request.client is not None else "unknown"


async def authenticate(request: Request, ctx: RequestContext) -> Principal | None:
    """Bind the caller's tenant to ``ctx``; None only when the config turned authentication off.

    A refused key raises :class:`KeyRefused` (401; a missing one in OpenAI's words); an address that
    failed too often gets 429 (:class:`~gateway.auth_failures.TooManyAuthFailures`) on every attempt,
    right key or not, while blocked.
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
        if exc.reason == "missing":
            _no_key(exc)
        raise
    tenant = principal.tenant
    ctx.identity = ctx.identity.authenticated(tenant, principal.key_id)
    structlog.contextvars.bind_contextvars(tenant=tenant.name)
    return principal
