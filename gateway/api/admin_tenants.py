"""Admin endpoints for tenants, API keys, config reload and audit verification (under ``/admin``).

Tenants and keys created here live in the tenant directory (:mod:`gateway.directory`);
those from the config file are listed but read-only. A write is refused (409) where it
could not hold on every replica: a per-process store while ``auth.replicas`` is above
one, or authentication turned off. A new key is returned once, in the response that
creates it; only its SHA-256 is stored and it is never logged. Every change is
appended to the audit chain with the admin credential that made it.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from core.errors import ConfigInvalid, Conflict, NotFound
from core.settings import Name, TenantConfig
from gateway.api.admin import credential_of, require_admin, services_of
from gateway.directory.live import LiveDirectory
from gateway.reload import reload_config
from gateway.services import Services
from gateway.settings import unmeasured_audio
from gateway.tenants import KeyEntry, mint_key
from observability.audit import AuditLog
from observability.audit.chain import Signer
from observability.audit.log import now_iso
from observability.audit.verify import verify_store

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_admin)])


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: Name


def _audit(services: Services) -> AuditLog:
    if services.audit is None:
        raise Conflict("audit verification needs the audit trail, and audit is disabled")
    return services.audit


def _live(services: Services) -> LiveDirectory:
    assert services.live is not None
    return services.live


async def _record(request: Request, services: Services, event: dict[str, Any]) -> None:
    """The change, with who made it (the credential, never a name from the body), on the chain and in the log."""
    event = {**event, "by": credential_of(request).to_json()}
    if services.audit is not None:
        await services.audit.append_event("admin_change", event)


def _tenant_json(services: Services, name: str) -> dict[str, Any]:
    entry = services.directory.tenants[name]
    keys = [k.id for k in services.directory.keys.values() if k.tenant == name]
    return {**entry.config.model_dump(mode="json"), "source": entry.source, "keys": keys}


def _check_tenant(services: Services, tenant: TenantConfig) -> None:
    if tenant.policy_set is not None and tenant.policy_set not in services.pipeline.chains:
        raise ConfigInvalid(f"no policy set named {tenant.policy_set!r}", param="policy_set")
    classes = [c.name for c in services.settings.traffic.priorities]
    if tenant.priority not in classes:
        raise ConfigInvalid(
            f"no request class named {tenant.priority!r} (traffic.priorities: {', '.join(classes)})",
            param="priority",
        )
    if (why := unmeasured_audio(services.settings, tenant)) is not None:
        raise ConfigInvalid(why, param="audio_seconds_per_minute")


@router.get("/tenants")
async def list_tenants(request: Request) -> JSONResponse:
    services = services_of(request)
    return JSONResponse({"tenants": [_tenant_json(services, n) for n in sorted(services.directory.tenants)]})


@router.post("/tenants", status_code=201)
async def create_tenant(request: Request, tenant: TenantConfig) -> JSONResponse:
    services = services_of(request)
    if tenant.name in services.directory.tenants:
        raise Conflict(f"tenant {tenant.name!r} already exists", param="name")
    _check_tenant(services, tenant)
    await _live(services).write(
        services.settings,
        services.auth_required,
        lambda st: st.put_tenant(tenant.name, tenant.model_dump_json(), now_iso()),
    )
    await services.refresh_directory()
    await _record(request, services, {"action": "tenant_created", "tenant": tenant.model_dump(mode="json")})
    log.info("tenant_created", tenant=tenant.name)
    return JSONResponse(_tenant_json(services, tenant.name), status_code=201)


@router.put("/tenants/{name}")
async def update_tenant(request: Request, name: str, tenant: TenantConfig) -> JSONResponse:
    services = services_of(request)
    entry = services.directory.tenants.get(name)
    if entry is None:
        raise NotFound(f"no tenant named {name!r}")
    if entry.source == "config":
        raise Conflict(f"tenant {name!r} is defined in the config file; change it there and reload")
    if tenant.name != name:
        raise ConfigInvalid("a tenant cannot be renamed", param="name")
    _check_tenant(services, tenant)
    await _live(services).write(
        services.settings,
        services.auth_required,
        lambda st: st.put_tenant(name, tenant.model_dump_json(), now_iso()),
    )
    await services.refresh_directory()
    await _record(request, services, {"action": "tenant_updated", "tenant": tenant.model_dump(mode="json")})
    log.info("tenant_updated", tenant=name)
    return JSONResponse(_tenant_json(services, name))


@router.get("/keys")
async def list_keys(request: Request) -> JSONResponse:
    services = services_of(request)
    return JSONResponse(
        {
            "keys": [
                {
                    "id": k.id,
                    "tenant": k.tenant,
                    "enabled": k.enabled,
                    "source": k.source,
                    "created_at": k.created_at,
                }
                for k in sorted(services.directory.keys.values(), key=lambda k: k.id)
            ]
        }
    )


@router.post("/keys", status_code=201)
async def create_key(request: Request, body: NewKey) -> JSONResponse:
    services = services_of(request)
    if body.tenant not in services.directory.tenants:
        raise NotFound(f"no tenant named {body.tenant!r}", param="tenant")
    minted = mint_key()
    created = now_iso()
    entry = KeyEntry(minted.id, body.tenant, minted.sha256, True, "admin", created)
    by = credential_of(request).name
    await _live(services).write(services.settings, services.auth_required, lambda st: st.add_key(entry, by))
    await services.refresh_directory()
    await _record(request, services, {"action": "key_created", "key_id": minted.id, "tenant": body.tenant})
    log.info("api_key_created", key_id=minted.id, tenant=body.tenant)
    return JSONResponse(
        {
            "id": minted.id,
            "key": minted.key,
            "tenant": body.tenant,
            "created_at": created,
            "note": "store this key now: it is not shown again",
        },
        status_code=201,
    )


@router.delete("/keys/{key_id}")
async def revoke_key(request: Request, key_id: str) -> JSONResponse:
    services = services_of(request)
    entry = services.directory.keys.get(key_id)
    if entry is None:
        raise NotFound(f"no key with id {key_id!r}")
    if entry.source == "config":
        raise Conflict(f"key {key_id!r} is defined in the config file; remove or disable it there and reload")
    await _live(services).write(
        services.settings, services.auth_required, lambda st: st.set_key_enabled(key_id, False)
    )
    await services.refresh_directory()
    await _record(request, services, {"action": "key_revoked", "key_id": key_id, "tenant": entry.tenant})
    log.info("api_key_revoked", key_id=key_id, tenant=entry.tenant)
    return JSONResponse({"id": key_id, "tenant": entry.tenant, "enabled": False})


@router.post("/config/reload")
async def reload(request: Request) -> JSONResponse:
    services = services_of(request)
    path = request.app.state.config_path
    if path is None:
        raise Conflict("the gateway was started without a config file; there is nothing to reload")
    result = await reload_config(services, path, by=credential_of(request).to_json())
    if not result.ok:
        raise ConfigInvalid(f"config not reloaded, the running config stays: {result.message}")
    return JSONResponse(result.to_json())


@router.get("/audit/verify")
async def verify(request: Request) -> JSONResponse:
    """Walk the live store's chain (the same check as ``omnigate audit verify``)."""
    services = services_of(request)
    audit = _audit(services)
    report = await verify_store(audit.store, Signer.from_settings(services.settings.audit.signing))
    return JSONResponse(report.to_json(), status_code=200 if report.ok else 409)
