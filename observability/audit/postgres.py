"""The PostgreSQL audit store (asyncpg). Commits are synchronous (the server's default ``synchronous_commit``).

Appends take a transaction-scoped advisory lock before reading the head, so every
gateway sharing the database extends one chain.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import asyncpg

from observability.audit.chain import GENESIS, Checkpoint, Row
from observability.audit.search import AuditQuery, select
from observability.audit.store import ROW_SELECT, Entry, chain_rows, schema

_LOCK = 0x6F6D6E6961756469  # "omniaudi": the advisory lock that serialises appends

_SCHEMA = schema("BIGINT", "BOOLEAN")
_ROW = ROW_SELECT


class PostgresStore:
    name = "postgres"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._pool: asyncpg.Pool | None = None
        # asyncpg talks to the server from the event loop; records are encoded on a thread of their own.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-encode")

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, command_timeout=30)
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
                await conn.execute(_SCHEMA)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        self._encoder.shutdown(wait=False)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the audit store is not open")
        return self._pool

    @staticmethod
    async def _head_in(conn: asyncpg.Connection) -> tuple[int, str]:
        row = await conn.fetchrow("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1")
        if row is not None:
            return int(row[0]), row[1]
        cp = await conn.fetchrow("SELECT seq, hash FROM audit_checkpoints ORDER BY seq DESC LIMIT 1")
        return (int(cp[0]), cp[1]) if cp is not None else (0, GENESIS)

    async def _append(self, entries: list[Entry]) -> list[Row]:
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
                rows = chain_rows(entries, *await self._head_in(conn))
                await conn.copy_records_to_table(
                    "audit_log",
                    records=[(r.seq, r.ts, r.kind, r.request_id, r.tenant, r.data, r.prev_hash, r.hash)
                             for r in rows],
                    columns=["seq", "ts", "kind", "request_id", "tenant", "data", "prev_hash", "hash"],
                )
        return rows

    async def append_encoded(self, encode: Callable[[], list[Entry]]) -> list[Row]:
        return await self._append(await asyncio.get_running_loop().run_in_executor(self._encoder, encode))

    async def head(self) -> tuple[int, str]:
        async with self.pool.acquire() as conn:
            return await self._head_in(conn)

    async def rows(self, after_seq: int, limit: int) -> list[Row]:
        recs = await self.pool.fetch(_ROW + " WHERE seq > $1 ORDER BY seq LIMIT $2", after_seq, limit)
        return [Row(*r) for r in recs]

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        sql, args = select(query, "postgres", _ROW, limit)
        return [Row(*r) for r in await self.pool.fetch(sql, *args)]

    async def seq_of_hash(self, digest: str) -> int | None:
        return await self.pool.fetchval("SELECT seq FROM audit_log WHERE hash = $1 LIMIT 1", digest)

    async def add_checkpoint(self, cp: Checkpoint) -> None:
        await self.pool.execute(
            "INSERT INTO audit_checkpoints (seq, hash, created_at, algorithm, key_id, signature) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (seq) DO NOTHING",
            cp.seq, cp.hash, cp.created_at, cp.algorithm, cp.key_id, cp.signature,
        )

    async def checkpoints(self) -> list[Checkpoint]:
        recs = await self.pool.fetch(
            "SELECT seq, hash, created_at, algorithm, key_id, signature FROM audit_checkpoints ORDER BY seq")
        return [Checkpoint(*r) for r in recs]

    async def cut_before(self, cutoff_ts: str) -> Checkpoint | None:
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
                r = await conn.fetchrow(
                    "SELECT c.seq, c.hash, c.created_at, c.algorithm, c.key_id, c.signature "
                    "FROM audit_checkpoints c JOIN audit_log l ON l.seq = c.seq WHERE l.ts < $1 "
                    "ORDER BY c.seq DESC LIMIT 1", cutoff_ts,
                )
                if r is None:
                    return None
                cp = Checkpoint(*r)
                await conn.execute("DELETE FROM audit_log WHERE seq <= $1", cp.seq)
                await conn.execute("DELETE FROM audit_checkpoints WHERE seq < $1", cp.seq)
        return cp
