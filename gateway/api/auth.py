"""Who is calling: resolves the Bearer key to a tenant before anything else reads the request."""

from __future__ import annotations

import structlog
from fastapi import Request

from gateway.context import RequestContext
from gateway.services import Services
from gateway.tenants import KeyRefused, Principal


def authenticate(request: Request, ctx: RequestContext) -> Principal | None:
    """Bind the caller's tenant to ``ctx``; None when authentication is off (no tenants configured)."""
    services: Services = request.app.state.services
    directory = services.directory
    if not directory.auth_enabled:
        return None
    try:
        principal = directory.authenticate(request.headers.get("authorization"))
    except KeyRefused as exc:
        services.metrics.auth_failures.labels(exc.reason).inc()
        ctx.key_id = exc.key_id
        raise
    tenant = principal.tenant
    ctx.tenant, ctx.tenant_config, ctx.key_id = tenant.name, tenant, principal.key_id
    ctx.priority, ctx.tenant_max_concurrency = tenant.priority, tenant.max_concurrency
    ctx.policy_set, ctx.audit_content = tenant.policy_set, tenant.audit_content
    structlog.contextvars.bind_contextvars(tenant=tenant.name)
    return principal
