"""Reading the audit trail under ``/admin/audit``: search with filters and paging, one record, export, range verify.

Behind the same admin credential as the rest of ``/admin``. Search pages newest
first: each page carries ``next_before_seq``, the cursor of the page after it.
Export streams the whole selection oldest first as JSON lines (each record with
its hashes, as ``omnigate audit export`` writes them), and is itself recorded in
the chain. The full-chain walk stays ``GET /admin/audit/verify``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.responses import JSONResponse, StreamingResponse

from core.errors import Conflict, NotFound
from gateway.api.admin import require_admin, services_of
from gateway.api.chat import validation_to_error
from observability.audit import AuditLog
from observability.audit.chain import Row, Signer
from observability.audit.search import AuditQuery
from observability.audit.verify_range import verify_range

router = APIRouter(prefix="/admin/audit", include_in_schema=False, dependencies=[Depends(require_admin)])

EXPORT_PAGE = 1000
Text = Annotated[str, Field(min_length=1, max_length=200)]
#: a record's place in the chain: the stores keep it in a signed 64-bit integer
Seq = Annotated[int, Field(ge=1, le=2**63 - 1)]


def _stored_ts(value: datetime) -> str:
    """The ``ts`` column's own format (UTC, microseconds, ``Z``), so range filters compare as text."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Filters(BaseModel):
    """The query string of a search or an export; unknown parameters are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")
    since: datetime | None = Field(
        default=None, description="records at or after this time (ISO 8601; UTC if naive)"
    )
    until: datetime | None = Field(default=None, description="records before this time")
    kind: Text | None = Field(default=None, description="request, routing_transition, admin_change, ...")
    tenant: Text | None = None
    request_id: Text | None = Field(default=None, description="the id the gateway gave the request")
    client_request_id: Text | None = Field(default=None, description="the id the client sent (x-request-id)")
    outcome: Text | None = Field(default=None, description="served, degraded, refused, failed, cancelled")
    engine: Text | None = None
    policy: Text | None = Field(default=None, description="a policy that ran on the request")
    verdict: Text | None = Field(default=None, description="a verdict one of its policies returned")
    degraded: Text | None = Field(default=None, description="a degradation reason, e.g. load-text-only")
    unscanned: Text | None = Field(
        default=None, description="a policy whose receipt says it did not look at all of the request"
    )

    @field_validator("since", "until")
    @classmethod
    def _representable(cls, v: datetime | None) -> datetime | None:
        # an offset that moves the time past year 1 or 9999 in UTC cannot be compared with the column
        if v is not None:
            try:
                _stored_ts(v)
            except OverflowError:
                raise ValueError("the time is out of range in UTC") from None
        return v

    @model_validator(mode="after")
    def _range(self) -> Filters:
        if (
            self.since is not None
            and self.until is not None
            and _stored_ts(self.since) >= _stored_ts(self.until)
        ):
            raise ValueError("since must be before until")
        return self

    def query(self, *, before_seq: int | None = None, after_seq: int | None = None) -> AuditQuery:
        fields: dict[str, Any] = {
            k: getattr(self, k) for k in Filters.model_fields if k not in ("since", "until")
        }
        return AuditQuery(
            since=_stored_ts(self.since) if self.since is not None else None,
            until=_stored_ts(self.until) if self.until is not None else None,
            before_seq=before_seq,
            after_seq=after_seq,
            **fields,
        )


class SearchParams(Filters):
    before_seq: Seq | None = Field(default=None, description="the page cursor")
    limit: Annotated[int, Field(ge=1, le=500)] = 50


class RangeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    from_seq: Seq
    to_seq: Seq

    @model_validator(mode="after")
    def _ordered(self) -> RangeParams:
        if self.to_seq < self.from_seq:
            raise ValueError("to_seq must not be below from_seq")
        return self


def _params(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise validation_to_error(exc.errors()) from None


def _audit(request: Request) -> AuditLog:
    audit = services_of(request).audit
    if audit is None:
        raise Conflict("audit is disabled on this gateway (audit.enabled: false)")
    return audit


def summary(row: Row) -> dict[str, Any]:
    """One line of a result list: the indexed columns and the payload fields an operator scans for."""
    payload = orjson.loads(row.data).get("payload") or {}
    out: dict[str, Any] = {
        "seq": row.seq,
        "ts": row.ts,
        "kind": row.kind,
        "request_id": row.request_id,
        "tenant": row.tenant,
    }
    if row.kind == "request":
        out.update(
            {
                k: payload.get(k)
                for k in ("public_model", "engine", "variant", "outcome", "status", "duration_ms")
            }
        )
        out["degraded"] = payload.get("degraded") or []
        out["policies"] = [
            f"{p.get('name')}:{p.get('verdict')}"
            + (" (shadow)" if p.get("shadow") else "")
            + (" (not all scanned)" if p.get("complete") is False else "")
            for p in payload.get("policies") or []
        ]
    else:
        out["action"] = payload.get("action")
    return out


@router.get("/records")
async def search(request: Request) -> JSONResponse:
    """Records matching the filters, newest first, ``limit`` per page."""
    params: SearchParams = _params(request, SearchParams)
    audit = _audit(request)
    q = params.query(before_seq=params.before_seq)
    rows = await audit.store.search(q, params.limit + 1)
    more = len(rows) > params.limit
    rows = rows[: params.limit]
    return JSONResponse(
        {
            "records": [summary(r) for r in rows],
            "next_before_seq": rows[-1].seq if more and rows else None,
            "filters": q.filters(),
        }
    )


@router.get("/records/{seq}")
async def record(request: Request, seq: Annotated[int, Path(le=2**63 - 1)]) -> JSONResponse:
    """One record in full: its payload as stored, and its place in the chain (``prev_hash``, ``hash``)."""
    audit = _audit(request)
    rows = await audit.store.rows(seq - 1, 1) if seq >= 1 else []
    if not rows or rows[0].seq != seq:
        raise NotFound(f"no audit record {seq}")
    return JSONResponse(rows[0].to_json())


@router.get("/export")
async def export(request: Request) -> StreamingResponse:
    """The selection as JSON lines, oldest first, streamed a page at a time."""
    filters: Filters = _params(request, Filters)
    audit = _audit(request)
    await audit.append_event("audit_export", {"filters": filters.query().filters()})

    async def lines() -> AsyncIterator[bytes]:
        after = 0
        while True:
            rows = await audit.store.search(filters.query(after_seq=after), EXPORT_PAGE)
            if not rows:
                return
            yield b"".join(orjson.dumps(r.to_json()) + b"\n" for r in rows)
            after = rows[-1].seq

    return StreamingResponse(
        lines(),
        media_type="application/x-ndjson",
        headers={
            "content-disposition": 'attachment; filename="omnigate-audit.jsonl"',
            "cache-control": "no-store",
        },
    )


@router.get("/verify/range")
async def verify_part(request: Request) -> JSONResponse:
    """Verify records ``from_seq..to_seq``; 409 with the problem (kind, ``seq``, message) when the chain breaks."""
    params: RangeParams = _params(request, RangeParams)
    services = services_of(request)
    audit = _audit(request)
    report = await verify_range(
        audit.store, Signer.from_settings(services.settings.audit.signing), params.from_seq, params.to_seq
    )
    body = {**report.to_json(), "range": {"from_seq": params.from_seq, "to_seq": params.to_seq}}
    return JSONResponse(body, status_code=200 if report.ok else 409)
