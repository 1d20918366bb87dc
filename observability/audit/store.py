"""What an audit store does; SQLite (:mod:`.sqlite`) and PostgreSQL (:mod:`.postgres`) implement it.

A store appends a batch in one transaction that holds the store's write lock
while it reads the chain's head, links the batch to it and inserts it, so several
gateways may share one store and still form a single chain. Tenants and API keys
are not kept here: they live in the tenant directory (:mod:`gateway.directory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from gateway.settings import AuditSettings
from observability.audit.chain import GENESIS, Checkpoint, Row, link
from observability.audit.search import AuditQuery


def schema(int_type: str, bool_type: str) -> str:
    """The tables every store keeps, in the dialect's integer and boolean types."""
    return f"""
CREATE TABLE IF NOT EXISTS audit_log (
    seq {int_type} PRIMARY KEY, ts TEXT NOT NULL, kind TEXT NOT NULL, request_id TEXT, tenant TEXT,
    data TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_log_hash ON audit_log (hash);
CREATE INDEX IF NOT EXISTS audit_log_request ON audit_log (request_id);
CREATE TABLE IF NOT EXISTS audit_checkpoints (
    seq {int_type} PRIMARY KEY, hash TEXT NOT NULL, created_at TEXT NOT NULL, algorithm TEXT NOT NULL,
    key_id TEXT NOT NULL, signature TEXT NOT NULL);
"""


#: the columns of one chain row, in the order ``Row`` takes them
ROW_SELECT = "SELECT seq, ts, kind, request_id, tenant, data, prev_hash, hash FROM audit_log"


@dataclass(frozen=True, slots=True)
class Entry:
    """A record ready to be chained: its canonical JSON and the indexed copies of its fields."""

    ts: str
    kind: str
    request_id: str | None
    tenant: str | None
    data: str


def chain_rows(entries: list[Entry], head_seq: int, head_hash: str) -> list[Row]:
    rows: list[Row] = []
    seq, prev = head_seq, head_hash or GENESIS
    for e in entries:
        seq += 1
        h = link(prev, e.data)
        rows.append(Row(seq, e.ts, e.kind, e.request_id, e.tenant, e.data, prev, h))
        prev = h
    return rows


class AuditStore(Protocol):
    name: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def append_encoded(self, encode: Callable[[], list[Entry]]) -> list[Row]:
        """Run ``encode`` (CPU-bound: digests, redaction, canonical JSON) off the loop; append what it returns.

        A store with a thread of its own runs both there, one hand-off per batch.
        """
        ...

    async def head(self) -> tuple[int, str]: ...

    async def rows(self, after_seq: int, limit: int) -> list[Row]: ...

    async def seq_of_hash(self, digest: str) -> int | None: ...

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        """Records matching ``query`` (see :mod:`.search`), newest first unless it pages forward."""
        ...

    async def add_checkpoint(self, cp: Checkpoint) -> None: ...

    async def checkpoints(self) -> list[Checkpoint]: ...

    async def cut_before(self, cutoff_ts: str) -> Checkpoint | None:
        """Delete the records up to the newest checkpoint older than ``cutoff_ts``; return that anchor."""
        ...


def build_store(settings: AuditSettings) -> AuditStore:
    if settings.store == "postgres":
        from observability.audit.postgres import PostgresStore

        assert settings.postgres_dsn is not None
        return PostgresStore(settings.postgres_dsn.get_secret_value())
    from observability.audit.sqlite import SQLiteStore

    return SQLiteStore(settings.sqlite_path)
