"""Read views for operators under ``/admin``: admission state, routing history, the resolved config, a config check.

``GET /admin/traffic`` is the admission gate now (in flight against the soft and
hard limits, overloaded or not, what was shed). ``GET /admin/routing/transitions``
is the history of routing transitions, automatic and manual: from the audit chain
when audit is on (every replica's, durable), else this replica's recent ones.
``GET /admin/config`` shows the engines as configured (no secrets) and the policy
chain each tenant resolves to; ``POST /admin/config/check`` validates the config
file as a reload would, and swaps nothing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import orjson
import structlog
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from core.errors import Conflict
from gateway.api.admin import require_admin, services_of
from gateway.api.chat import validation_to_error
from gateway.chains import build_policy_sets
from gateway.reload import RESTART_ONLY, format_config_error
from gateway.settings import load_settings
from observability.audit.search import AuditQuery
from observability.metrics import SHED_REASONS
from policies.registry import build_chain

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_admin)])


def _counter_values(counter: Any) -> dict[str, float]:
    """A labelled counter's totals by its one label, read through the collector API."""
    out: dict[str, float] = {}
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[next(iter(s.labels.values()), "")] = s.value
    return out


@router.get("/traffic")
async def traffic(request: Request) -> JSONResponse:
    services = services_of(request)
    gate = services.admission
    if gate is None:
        return JSONResponse({"enabled": False})
    cfg = gate.cfg
    try:
        in_flight: int | None = await gate.store.in_flight()
        error = None
    except Exception as exc:  # a shared store that is down is shown, not turned into a 500
        in_flight, error = None, type(exc).__name__
    shed = _counter_values(services.metrics.admission_shed)
    return JSONResponse(
        {
            "enabled": True,
            "store": gate.store.name,
            "store_error": error,
            "in_flight": in_flight,
            "soft_limit": cfg.soft_limit,
            "hard_limit": cfg.hard_limit,
            "overload_exit": cfg.overload_exit,
            "overloaded": gate.overloaded,
            "priorities": [
                {"name": c.name, "soft": s, "hard": h}
                for c in cfg.priorities
                for s, h in [cfg.class_limits(c.name)]
            ],
            # counted on this replica since it started
            "shed": {r: int(shed.get(r, 0)) for r in SHED_REASONS},
        }
    )


class TransitionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    before_seq: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    limit: Annotated[int, Field(ge=1, le=500)] = 50


def _with_timing(t: dict[str, Any]) -> dict[str, Any]:
    """Add ``took_s``: from detection (a fired rule) or from the incident's start (a restore) to the change."""
    detail = t.get("detail") or {}
    began = detail.get("detected_at", detail.get("incident_since"))
    if isinstance(began, (int, float)) and isinstance(t.get("at"), (int, float)):
        t["took_s"] = round(t["at"] - began, 3)
    return t


@router.get("/routing/transitions")
async def transitions(request: Request) -> JSONResponse:
    try:
        params = TransitionParams.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise validation_to_error(exc.errors()) from None
    services = services_of(request)
    if services.audit is None:
        recent = [_with_timing(t.to_dict()) for t in reversed(services.controller.recent)]
        return JSONResponse(
            {"source": "replica", "transitions": recent[: params.limit], "next_before_seq": None}
        )
    q = AuditQuery(kind="routing_transition", before_seq=params.before_seq)
    rows = await services.audit.store.search(q, params.limit + 1)
    page = rows[: params.limit]
    out = []
    for r in page:
        t = dict(orjson.loads(r.data).get("payload") or {})
        out.append({"seq": r.seq, "ts": r.ts, **_with_timing(t)})
    return JSONResponse(
        {
            "source": "audit",
            "transitions": out,
            "next_before_seq": page[-1].seq if len(rows) > params.limit and page else None,
        }
    )


_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", re.IGNORECASE)


def _no_userinfo(url: Any) -> Any:
    return _USERINFO.sub(r"\1", url) if isinstance(url, str) else url


def _engine_json(e: Any) -> dict[str, Any]:
    """An engine as configured, without what may be a credential: its api_key and any user:password in a URL."""
    doc: dict[str, Any] = e.model_dump(mode="json", exclude={"api_key"})
    doc["base_url"] = _no_userinfo(doc.get("base_url"))
    telemetry = doc.get("telemetry") or {}
    for k in ("metrics_url", "dcgm_url"):
        if k in telemetry:
            telemetry[k] = _no_userinfo(telemetry[k])
    return doc


@router.get("/config")
async def config(request: Request) -> JSONResponse:
    services = services_of(request)
    chains = services.pipeline.chains
    tenants = []
    for name in sorted(services.directory.tenants):
        entry = services.directory.tenants[name]
        chosen = entry.config.policy_set
        chain = chains.get(chosen) if chosen is not None else services.chain
        tenants.append(
            {
                "name": name,
                "source": entry.source,
                "priority": entry.config.priority,
                "policy_set": chosen,
                "chain": chain.describe() if chain is not None else None,
            }
        )
    return JSONResponse(
        {
            "engines": [_engine_json(e) for e in services.settings.engines],
            "policies": services.chain.describe(),
            "policy_sets": {n: c.describe() for n, c in sorted(chains.items())},
            "tenants": tenants,
            "reloadable": request.app.state.config_path is not None,
        }
    )


@router.post("/config/check")
async def check(request: Request) -> JSONResponse:
    """What ``POST /admin/config/reload`` would say about the file now, without swapping anything."""
    services = services_of(request)
    path = request.app.state.config_path
    if path is None:
        raise Conflict("the gateway was started without a config file; there is nothing to check")
    try:
        new = load_settings(path)
        build_chain(new.policies, services.plugins)
        build_policy_sets(new, services.plugins)
    except Exception as exc:  # any failure is the file's, reported as a reload reports it
        return JSONResponse({"ok": False, "message": format_config_error(exc), "restart_required": []})
    old = services.settings
    pending = [k for k in RESTART_ONLY if getattr(new, k) != getattr(old, k)]
    changed = [k for k in type(new).model_fields if getattr(new, k) != getattr(old, k) and k not in pending]
    return JSONResponse(
        {
            "ok": True,
            "message": "the file is valid; a reload would apply it",
            "applies_at_once": changed,
            "restart_required": pending,
        }
    )
