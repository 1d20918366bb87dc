"""The admin API: a router of its own under ``/admin``, never in the public schema.

Every route depends on :func:`require_admin`. With no admin credential configured
(``admin.api_key`` or ``admin.keys``) the whole surface answers 404, as if it did not
exist. The credential that made a call is what the audit trail and the log record
for it (``admin_credential``); a name a caller writes in a body is never taken for it.
With the console on, a console session cookie is accepted in place of the Bearer key
(gateway/api/console_session.py) and recorded as the credential ``console-session``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import structlog
from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

from core.errors import AuthenticationFailed, OmnigateError
from gateway.api import console_session
from gateway.api.auth import client_address
from gateway.services import Services
from gateway.settings import Settings


class AdminDisabled(OmnigateError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


@dataclass(frozen=True, slots=True)
class AdminCredential:
    """Which admin credential made a call: its configured name and the first 12 hex digits of its digest."""

    name: str
    fingerprint: str

    @property
    def label(self) -> str:
        return f"admin:{self.name}"

    def to_json(self) -> dict[str, str]:
        return {"credential": self.name, "fingerprint": self.fingerprint}


def admin_credential(settings: Settings, authorization: str | None) -> AdminCredential | None:
    """The admin credential an ``Authorization`` header carries, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    digest = hashlib.sha256(token.encode()).hexdigest()
    found: AdminCredential | None = None
    key = settings.admin.api_key
    # Every candidate is compared, so the time taken says nothing about which one matched.
    if key is not None and hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        found = AdminCredential("api_key", digest[:12])
    for k in settings.admin.keys:
        if hmac.compare_digest(digest, k.sha256) and found is None:
            found = AdminCredential(k.name, digest[:12])
    return found


def services_of(request: Request) -> Services:
    """The running gateway's services (the app state carries them untyped)."""
    services: Services = request.app.state.services
    return services


async def require_admin(request: Request) -> AdminCredential:
    services = services_of(request)
    if not services.settings.admin.enabled:
        raise AdminDisabled("Not Found")
    # Before any credential is looked at: a blocked address is refused whatever it sends.
    services.auth_failures.check(client_address(request))
    header = request.headers.get("authorization", "")
    key = services.settings.admin.api_key
    # The console's browser calls carry its session cookie instead (and a CSRF token on changes).
    console = not header and key is not None and services.settings.admin.console.enabled
    if (
        console
        and key is not None
        and console_session.from_request(request, key.get_secret_value()) is not None
    ):
        cred: AdminCredential | None = AdminCredential("console-session", "session")
    else:
        cred = admin_credential(services.settings, header)
    if cred is None:
        # Counted and limited per address like a refused API key: the admin key is not a free guess.
        services.metrics.auth_failures.labels("admin").inc()
        await services.auth_failures.failed(client_address(request), "admin")
        raise AuthenticationFailed("invalid admin key")
    request.state.admin_credential = cred
    structlog.contextvars.bind_contextvars(admin_credential=cred.name)
    return cred


def credential_of(request: Request) -> AdminCredential:
    """The credential :func:`require_admin` found for this request."""
    cred: AdminCredential = request.state.admin_credential
    return cred


router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_admin)])


@router.get("/engines")
async def engines(request: Request) -> JSONResponse:
    """Each engine's configuration (no secrets) and current health."""
    services = services_of(request)
    health = services.pool.health_report()
    return JSONResponse(
        {
            "engines": [
                {
                    "name": e.name,
                    "kind": e.kind,
                    "variant": e.variant,
                    "role": e.role,
                    "serves": e.serves,
                    "model": e.model,
                    "healthy": health.get(e.name, False),
                }
                for e in services.settings.engines
            ],
            "policies": services.chain.describe(),
        }
    )
