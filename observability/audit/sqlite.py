"""The SQLite audit store: WAL journal, ``synchronous=FULL`` (each commit is fsynced), one writer thread.

``BEGIN IMMEDIATE`` takes the database's write lock before the head is read, so
processes sharing the file still append to one chain. Reads (search, export, the
chain walks) run on a read-only connection of their own thread
(:class:`~observability.sqlite_worker.SQLiteWorker`), so however long an admin read
takes, commits do not wait behind it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from observability.audit.chain import GENESIS, Checkpoint, Row
from observability.audit.search import AuditQuery, select
from observability.audit.store import (
    CHECKPOINT_V2_COLUMNS,
    CP_INSERT,
    CP_SELECT,
    NEWEST_BEFORE,
    ROW_SELECT,
    Entry,
    Sealer,
    Tip,
    chain_rows,
    cp_values,
    schema,
)
from observability.sqlite_worker import SQLiteWorker

_SCHEMA = schema("INTEGER", "INTEGER")
_ROW = ROW_SELECT


class SQLiteStore(SQLiteWorker):
    name = "sqlite"
    what = "audit"

    # -- lifecycle (on the store's own thread) --------------------------------------------------------
    def _open(self) -> None:
        db = self._connect(_SCHEMA)
        have = {r[1] for r in db.execute("PRAGMA table_info(audit_checkpoints)")}
        for name, sql_type in CHECKPOINT_V2_COLUMNS:
            if name not in have:
                db.execute(
                    f"ALTER TABLE audit_checkpoints ADD COLUMN {name} {sql_type.format(int_type='INTEGER')}"
                )
        self._db = db

    # -- the chain --------------------------------------------------------------------------------------
    def _head(self) -> tuple[int, str]:
        row = self.db.execute("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1").fetchone()
        if row is not None:
            return int(row[0]), row[1]
        # An empty log after a retention cut continues from the anchoring checkpoint.
        cp = self.db.execute("SELECT seq, hash FROM audit_checkpoints ORDER BY seq DESC LIMIT 1").fetchone()
        return (int(cp[0]), cp[1]) if cp is not None else (0, GENESIS)

    def _newest_cp(self) -> Checkpoint | None:
        r = self.db.execute(CP_SELECT + " ORDER BY seq DESC LIMIT 1").fetchone()
        return None if r is None else Checkpoint(*r)

    def _tip(self, seal: Sealer) -> Tip:
        """The chain's end and what ``seal`` asks about it, read under the write lock."""
        head_seq, head_hash = self._head()
        newest = self._newest_cp()
        seqs, want_first = seal.wants(newest, head_seq)
        hashes: dict[int, str] = {}
        if seqs:
            marks = ", ".join("?" * len(seqs))
            hashes = dict(self.db.execute(f"SELECT seq, hash FROM audit_log WHERE seq IN ({marks})", seqs))
        first = None
        if want_first:
            r = self.db.execute("SELECT data FROM audit_log WHERE seq = 1").fetchone()
            first = None if r is None else r[0]
        return Tip(head_seq, head_hash, newest, hashes, first)

    def _insert(self, entries: list[Entry], seal: Sealer | None, judged: bool = False) -> list[Row]:
        """Inside a transaction holding the write lock: judge the chain's end, chain, insert, maybe seal."""
        db = self.db
        if seal is not None and not judged:
            entries = seal.admit(self._tip(seal), entries)
        rows = chain_rows(entries, *self._head())
        db.executemany(
            "INSERT INTO audit_log (seq, ts, kind, request_id, tenant, data, prev_hash, hash) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(r.seq, r.ts, r.kind, r.request_id, r.tenant, r.data, r.prev_hash, r.hash) for r in rows],
        )
        if seal is not None and rows:
            self._add_sealed(seal, rows[-1].seq, rows[-1].hash)
        return rows

    def _add_sealed(self, seal: Sealer, seq: int, head: str) -> None:
        cp = seal.seal(self._newest_cp(), seq, head)
        if cp is not None:
            self.db.execute(CP_INSERT + "(?, ?, ?, ?, ?, ?, ?, ?)", cp_values(cp))

    async def append_encoded(
        self, encode: Callable[[], list[Entry]], seal: Sealer | None = None
    ) -> list[Row]:
        def q() -> list[Row]:
            entries = encode()  # before the lock: encoding is the slow part
            return self._locked(lambda: self._insert(entries, seal))

        return await self._run(q)

    def _seal_head(self, seal: Sealer) -> None:
        seal.admit(self._tip(seal), [])
        self._add_sealed(seal, *self._head())

    async def seal_head(self, seal: Sealer) -> None:
        await self._run(self._locked, lambda: self._seal_head(seal))

    async def head(self) -> tuple[int, str]:
        return await self._run(self._head)

    # -- reads: on the read-only connection (see the module docstring) -----------------------------------
    async def rows(self, after_seq: int, limit: int) -> list[Row]:
        def q(db: sqlite3.Connection) -> list[Row]:
            cur = db.execute(_ROW + " WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
            return [Row(*r) for r in cur.fetchall()]

        return await self._read(q)

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        sql, args = select(query, "sqlite", _ROW, limit)
        return await self._read(lambda db: [Row(*r) for r in db.execute(sql, args).fetchall()])

    async def seq_of_hash(self, digest: str) -> int | None:
        def q(db: sqlite3.Connection) -> int | None:
            r = db.execute("SELECT seq FROM audit_log WHERE hash = ? LIMIT 1", (digest,)).fetchone()
            return None if r is None else int(r[0])

        return await self._read(q)

    async def checkpoints(self) -> list[Checkpoint]:
        def q(db: sqlite3.Connection) -> list[Checkpoint]:
            return [Checkpoint(*r) for r in db.execute(CP_SELECT + " ORDER BY seq").fetchall()]

        return await self._read(q)

    def _cut(self, cutoff_ts: str, record: Callable[[Checkpoint], Entry], seal: Sealer) -> Checkpoint | None:
        db = self.db
        seal.admit(self._tip(seal), [])  # judged whole, before anything is deleted
        r = db.execute(
            CP_SELECT + " WHERE seq = (" + NEWEST_BEFORE.format(param="?") + ")", (cutoff_ts,)
        ).fetchone()
        if r is None:
            return None
        cp = Checkpoint(*r)
        db.execute("DELETE FROM audit_log WHERE seq <= ?", (cp.seq,))
        db.execute("DELETE FROM audit_checkpoints WHERE seq < ?", (cp.seq,))
        self._insert([record(cp)], seal, judged=True)
        return cp

    async def cut_before(
        self, cutoff_ts: str, record: Callable[[Checkpoint], Entry], seal: Sealer
    ) -> Checkpoint | None:
        return await self._run(self._locked, lambda: self._cut(cutoff_ts, record, seal))
