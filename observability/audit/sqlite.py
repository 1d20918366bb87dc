"""The SQLite audit store: WAL journal, ``synchronous=FULL`` (each commit is fsynced), one worker thread.

``BEGIN IMMEDIATE`` takes the database's write lock before the head is read, so
processes sharing the file still append to one chain.
"""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from observability.audit.chain import GENESIS, Checkpoint, Row
from observability.audit.search import AuditQuery, select
from observability.audit.store import ROW_SELECT, Entry, chain_rows, schema

T = TypeVar("T")

_SCHEMA = schema("INTEGER", "INTEGER")
_ROW = ROW_SELECT


class SQLiteStore:
    name = "sqlite"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-sqlite")
        self._db: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- lifecycle (on the store's own thread) --------------------------------------------------------
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        self._db = db

    async def open(self) -> None:
        await self._run(self._open)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the audit store is not open")
        return self._db

    # -- the chain --------------------------------------------------------------------------------------
    def _head(self) -> tuple[int, str]:
        row = self.db.execute("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1").fetchone()
        if row is not None:
            return int(row[0]), row[1]
        # An empty log after a retention cut continues from the anchoring checkpoint.
        cp = self.db.execute("SELECT seq, hash FROM audit_checkpoints ORDER BY seq DESC LIMIT 1").fetchone()
        return (int(cp[0]), cp[1]) if cp is not None else (0, GENESIS)

    def _append(self, entries: list[Entry]) -> list[Row]:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            rows = chain_rows(entries, *self._head())
            db.executemany(
                "INSERT INTO audit_log (seq, ts, kind, request_id, tenant, data, prev_hash, hash) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(r.seq, r.ts, r.kind, r.request_id, r.tenant, r.data, r.prev_hash, r.hash) for r in rows],
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return rows

    async def append_encoded(self, encode: Callable[[], list[Entry]]) -> list[Row]:
        return await self._run(lambda: self._append(encode()))

    async def head(self) -> tuple[int, str]:
        return await self._run(self._head)

    def _rows(self, after_seq: int, limit: int) -> list[Row]:
        cur = self.db.execute(_ROW + " WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return [Row(*r) for r in cur.fetchall()]

    async def rows(self, after_seq: int, limit: int) -> list[Row]:
        return await self._run(self._rows, after_seq, limit)

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        sql, args = select(query, "sqlite", _ROW, limit)
        return await self._run(lambda: [Row(*r) for r in self.db.execute(sql, args).fetchall()])

    async def seq_of_hash(self, digest: str) -> int | None:
        def q() -> int | None:
            r = self.db.execute("SELECT seq FROM audit_log WHERE hash = ? LIMIT 1", (digest,)).fetchone()
            return None if r is None else int(r[0])

        return await self._run(q)

    async def add_checkpoint(self, cp: Checkpoint) -> None:
        def q() -> None:
            self.db.execute(
                "INSERT OR IGNORE INTO audit_checkpoints (seq, hash, created_at, algorithm, key_id, signature) "
                "VALUES (?, ?, ?, ?, ?, ?)", (cp.seq, cp.hash, cp.created_at, cp.algorithm, cp.key_id, cp.signature)
            )

        await self._run(q)

    async def checkpoints(self) -> list[Checkpoint]:
        def q() -> list[Checkpoint]:
            cur = self.db.execute(
                "SELECT seq, hash, created_at, algorithm, key_id, signature FROM audit_checkpoints ORDER BY seq")
            return [Checkpoint(*r) for r in cur.fetchall()]

        return await self._run(q)

    def _cut(self, cutoff_ts: str) -> Checkpoint | None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            r = db.execute(
                "SELECT c.seq, c.hash, c.created_at, c.algorithm, c.key_id, c.signature FROM audit_checkpoints c "
                "JOIN audit_log l ON l.seq = c.seq WHERE l.ts < ? ORDER BY c.seq DESC LIMIT 1", (cutoff_ts,)
            ).fetchone()
            if r is None:
                db.execute("COMMIT")
                return None
            cp = Checkpoint(*r)
            db.execute("DELETE FROM audit_log WHERE seq <= ?", (cp.seq,))
            db.execute("DELETE FROM audit_checkpoints WHERE seq < ?", (cp.seq,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return cp

    async def cut_before(self, cutoff_ts: str) -> Checkpoint | None:
        return await self._run(self._cut, cutoff_ts)
