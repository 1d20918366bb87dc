"""Audit search: the filters an operator or auditor can put on the chain, as one SQL ``WHERE`` per dialect.

Column filters (time range, kind, tenant, request id) use the table's own
columns; the others look inside the record's canonical JSON (``payload.outcome``,
``payload.engine``, ``payload.client_request_id``, ``payload.policies[*]`` (a policy's name, verdict, or a receipt that
says it did not look at everything: ``unscanned``),
``payload.degraded[*]``), with
SQLite's JSON1 functions or PostgreSQL's ``jsonb``. Values are always bound as
parameters, never formatted into the SQL. Paging is by ``seq``: newest first
below a ``before_seq`` cursor, or oldest first above an ``after_seq`` one (export).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import orjson

Dialect = Literal["sqlite", "postgres"]


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """Every field is optional; set fields are ANDed. Times are ISO 8601 UTC, as the ``ts`` column stores them."""

    since: str | None = None  # ts >= since
    until: str | None = None  # ts < until
    kind: str | None = None
    tenant: str | None = None
    request_id: str | None = None
    client_request_id: str | None = None  # the id a client sent, kept beside the gateway's own
    outcome: str | None = None
    engine: str | None = None
    policy: str | None = None
    verdict: str | None = None
    degraded: str | None = None
    #: a policy whose receipt says it could not look at all of the request (``complete`` false)
    unscanned: str | None = None
    before_seq: int | None = None
    after_seq: int | None = None

    def filters(self) -> dict[str, Any]:
        """The set filters (cursors excluded), as echoed back to the caller."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) is not None and not f.name.endswith("_seq")
        }


def where(q: AuditQuery, dialect: Dialect) -> tuple[str, list[Any]]:
    """The ``WHERE`` clause (empty when nothing is set) and its parameters, in order."""
    args: list[Any] = []

    def p(value: Any) -> str:
        args.append(value)
        return "?" if dialect == "sqlite" else f"${len(args)}"

    def field_of(path: str) -> str:
        # path is one of the fixed names below, never caller input
        if dialect == "sqlite":
            return f"json_extract(data, '$.payload.{path}')"
        return f"(data::jsonb #>> '{{payload,{path}}}')"

    clauses: list[str] = []
    if q.since is not None:
        clauses.append(f"ts >= {p(q.since)}")
    if q.until is not None:
        clauses.append(f"ts < {p(q.until)}")
    for column in ("kind", "tenant", "request_id"):
        value = getattr(q, column)
        if value is not None:
            clauses.append(f"{column} = {p(value)}")
    for name in ("client_request_id", "outcome", "engine"):
        value = getattr(q, name)
        if value is not None:
            clauses.append(f"{field_of(name)} = {p(value)}")
    if q.policy is not None or q.verdict is not None:
        if dialect == "sqlite":
            conds = []
            if q.policy is not None:
                conds.append(f"json_extract(r.value, '$.name') = {p(q.policy)}")
            if q.verdict is not None:
                conds.append(f"json_extract(r.value, '$.verdict') = {p(q.verdict)}")
            clauses.append(
                f"EXISTS (SELECT 1 FROM json_each(data, '$.payload.policies') r WHERE {' AND '.join(conds)})"
            )
        else:
            run = {k: v for k, v in (("name", q.policy), ("verdict", q.verdict)) if v is not None}
            clauses.append(
                f"(data::jsonb -> 'payload' -> 'policies') @> {p(orjson.dumps([run]).decode())}::jsonb"
            )
    if q.unscanned is not None:
        if dialect == "sqlite":
            clauses.append(
                "EXISTS (SELECT 1 FROM json_each(data, '$.payload.policies') r WHERE "
                f"json_extract(r.value, '$.name') = {p(q.unscanned)} AND json_extract(r.value, '$.complete') = 0)"
            )
        else:
            missed = orjson.dumps([{"name": q.unscanned, "complete": False}]).decode()
            clauses.append(f"(data::jsonb -> 'payload' -> 'policies') @> {p(missed)}::jsonb")
    if q.degraded is not None:
        if dialect == "sqlite":
            clauses.append(
                f"EXISTS (SELECT 1 FROM json_each(data, '$.payload.degraded') d WHERE d.value = {p(q.degraded)})"
            )
        else:
            clauses.append(
                f"(data::jsonb -> 'payload' -> 'degraded') @> {p(orjson.dumps([q.degraded]).decode())}::jsonb"
            )
    if q.before_seq is not None:
        clauses.append(f"seq < {p(q.before_seq)}")
    if q.after_seq is not None:
        clauses.append(f"seq > {p(q.after_seq)}")
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def select(q: AuditQuery, dialect: Dialect, row_select: str, limit: int) -> tuple[str, list[Any]]:
    """The whole statement: newest first, unless paging forward (``after_seq``) as an export does."""
    sql, args = where(q, dialect)
    order = "ASC" if q.after_seq is not None and q.before_seq is None else "DESC"
    args.append(limit)
    limit_ph = "?" if dialect == "sqlite" else f"${len(args)}"
    return f"{row_select}{sql} ORDER BY seq {order} LIMIT {limit_ph}", args
