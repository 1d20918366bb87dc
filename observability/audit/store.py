"""What an audit store does; SQLite (:mod:`.sqlite`) and PostgreSQL (:mod:`.postgres`) implement it.

A store appends a batch in one transaction that holds the store's write lock
while it reads the chain's head, links the batch to it and inserts it, so several
gateways may share one store and still form a single chain. Under that lock the
writer's :class:`Sealer` first judges the chain's end (:class:`Tip`) and may refuse
it, then checkpoints the new head when the cadence says so. Tenants and API keys
are not kept here: they live in the tenant directory (:mod:`gateway.directory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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
    key_id TEXT NOT NULL, signature TEXT NOT NULL, prev_cp TEXT NOT NULL DEFAULT '',
    cadence {int_type} NOT NULL DEFAULT 0);
"""


#: columns a checkpoint gained with format v2 (added to a store created before), as (name, SQL type)
CHECKPOINT_V2_COLUMNS = (
    ("prev_cp", "TEXT NOT NULL DEFAULT ''"),
    ("cadence", "{int_type} NOT NULL DEFAULT 0"),
)

#: the columns of one checkpoint, in the order ``Checkpoint`` takes them
CP_SELECT = (
    "SELECT seq, hash, created_at, algorithm, key_id, signature, prev_cp, cadence FROM audit_checkpoints"
)
CP_INSERT = (
    "INSERT INTO audit_checkpoints (seq, hash, created_at, algorithm, key_id, signature, prev_cp, cadence) "
    "VALUES "
)


#: the newest checkpoint at a record older than the parameter (a retention cut's anchor)
NEWEST_BEFORE = (
    "SELECT MAX(c.seq) FROM audit_checkpoints c JOIN audit_log l ON l.seq = c.seq WHERE l.ts < {param}"
)


def cp_values(cp: Checkpoint) -> tuple[object, ...]:
    return (cp.seq, cp.hash, cp.created_at, cp.algorithm, cp.key_id, cp.signature, cp.prev, cp.every)


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


@dataclass(frozen=True, slots=True)
class Tip:
    """The chain's end as a store reads it under its write lock, before it links a batch to it."""

    head_seq: int
    head_hash: str
    newest: Checkpoint | None
    #: the stored hash of each record the sealer asked about (a record that is not there is absent)
    hashes: dict[int, str]
    #: record 1's data, when the sealer asked for it
    first: str | None = None


class Sealer(Protocol):
    """What a store calls inside its write transaction (the writer's side: :mod:`.guard`)."""

    def wants(self, newest: Checkpoint | None, head_seq: int) -> tuple[tuple[int, ...], bool]:
        """The records whose stored hashes :class:`Tip` should carry, and whether it needs record 1's data."""
        ...

    def admit(self, tip: Tip, entries: list[Entry]) -> list[Entry]:
        """Judge the chain's end before ``entries`` are linked to it: raise
        :class:`~observability.audit.chain.ChainBroken` to refuse it; return the entries to append
        (record 1 of a new chain carries the chain's statement)."""
        ...

    def seal(self, newest: Checkpoint | None, seq: int, head: str) -> Checkpoint | None:
        """After the append: the checkpoint of the new head ``(seq, head)`` to add, if one is due."""
        ...


class AuditStore(Protocol):
    name: str

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def append_encoded(
        self, encode: Callable[[], list[Entry]], seal: Sealer | None = None
    ) -> list[Row]:
        """Run ``encode`` (CPU-bound: digests, redaction, canonical JSON) off the loop; append what it returns.

        A store with a thread of its own runs both there, one hand-off per batch. In
        the same transaction, ``seal.admit`` judges the chain's end first and
        ``seal.seal`` may return a checkpoint of the new head, added with the records.
        """
        ...

    async def seal_head(self, seal: Sealer) -> None:
        """Under the write lock, let ``seal`` judge the chain's end, then add the checkpoint it makes of it."""
        ...

    async def head(self) -> tuple[int, str]: ...

    async def rows(self, after_seq: int, limit: int) -> list[Row]: ...

    async def seq_of_hash(self, digest: str) -> int | None: ...

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        """Records matching ``query`` (see :mod:`.search`), newest first unless it pages forward."""
        ...

    async def checkpoints(self) -> list[Checkpoint]: ...

    async def cut_before(
        self, cutoff_ts: str, record: Callable[[Checkpoint], Entry], seal: Sealer
    ) -> Checkpoint | None:
        """Delete the records up to the newest checkpoint older than ``cutoff_ts``; return that anchor.

        In the same transaction (once ``seal`` has judged the chain's end, before anything
        is deleted), append ``record(anchor)`` (the ``retention_cut`` record) and the
        checkpoint ``seal`` makes of it.
        """
        ...
