"""The PostgreSQL audit store (asyncpg). Commits are synchronous (the server's default ``synchronous_commit``).

Appends take a transaction-scoped advisory lock before reading the head, so every
gateway sharing the database extends one chain. Reads (search, export, the chain
walks) take their connections from a pool of their own: however many admin reads
run, and however long, the writer's pool always has a connection for the next commit
(and MVCC reads take no lock a commit waits for).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import asyncpg
import structlog

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

log = structlog.get_logger("omnigate.audit")

_LOCK = 0x6F6D6E6961756469  # "omniaudi": the advisory lock that serialises appends

_SCHEMA = schema("BIGINT", "BOOLEAN")
_ROW = ROW_SELECT


#: how long a close waits for the connections in use to come back before it cuts them
_CLOSE_S = 10.0


async def _close_pool(pool: asyncpg.Pool) -> None:
    """asyncpg's ``close`` waits for every connection in use to be released, without limit: a query
    stuck on a server that stopped answering would hold the gateway's stop for good. After ``_CLOSE_S``
    the connections are cut (``terminate``); an append then in flight was not acknowledged, so its
    request had not been answered as audited."""
    try:
        await asyncio.wait_for(pool.close(), _CLOSE_S)
    except TimeoutError:
        log.error("audit_store_close_timed_out", after_s=_CLOSE_S)
        pool.terminate()


class PostgresStore:
    name = "postgres"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._pool: asyncpg.Pool | None = None
        self._read_pool: asyncpg.Pool | None = None
        # asyncpg talks to the server from the event loop; records are encoded on a thread of their own.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-encode")

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=4, command_timeout=30)
        self._read_pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2, command_timeout=300)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            await conn.execute(_SCHEMA)
            for name, sql_type in CHECKPOINT_V2_COLUMNS:
                await conn.execute(
                    f"ALTER TABLE audit_checkpoints ADD COLUMN IF NOT EXISTS {name} "
                    f"{sql_type.format(int_type='BIGINT')}"
                )

    async def close(self) -> None:
        for pool in (self._read_pool, self._pool):
            if pool is not None:
                await _close_pool(pool)
        self._read_pool = self._pool = None
        self._encoder.shutdown(wait=False)

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the audit store is not open")
        return self._pool

    @property
    def reads(self) -> asyncpg.Pool:
        """The readers' pool (see the module docstring)."""
        if self._read_pool is None:
            raise RuntimeError("the audit store is not open")
        return self._read_pool

    @staticmethod
    async def _head_in(conn: asyncpg.Connection) -> tuple[int, str]:
        row = await conn.fetchrow("SELECT seq, hash FROM audit_log ORDER BY seq DESC LIMIT 1")
        if row is not None:
            return int(row[0]), row[1]
        cp = await conn.fetchrow("SELECT seq, hash FROM audit_checkpoints ORDER BY seq DESC LIMIT 1")
        return (int(cp[0]), cp[1]) if cp is not None else (0, GENESIS)

    @classmethod
    async def _tip(cls, conn: asyncpg.Connection, seal: Sealer) -> Tip:
        """The chain's end and what ``seal`` asks about it, read under the advisory lock."""
        head_seq, head_hash = await cls._head_in(conn)
        r = await conn.fetchrow(CP_SELECT + " ORDER BY seq DESC LIMIT 1")
        newest = None if r is None else Checkpoint(*r)
        seqs, want_first = seal.wants(newest, head_seq)
        hashes: dict[int, str] = {}
        if seqs:
            found = await conn.fetch(
                "SELECT seq, hash FROM audit_log WHERE seq = ANY($1::bigint[])", list(seqs)
            )
            hashes = {int(x[0]): x[1] for x in found}
        first = await conn.fetchval("SELECT data FROM audit_log WHERE seq = 1") if want_first else None
        return Tip(head_seq, head_hash, newest, hashes, first)

    @classmethod
    async def _insert(
        cls, conn: asyncpg.Connection, entries: list[Entry], seal: Sealer | None, judged: bool = False
    ) -> list[Row]:
        """Inside a transaction holding the advisory lock: judge the chain's end, chain, insert, maybe seal."""
        if seal is not None and not judged:
            entries = seal.admit(await cls._tip(conn, seal), entries)
        rows = chain_rows(entries, *await cls._head_in(conn))
        await conn.copy_records_to_table(
            "audit_log",
            records=[
                (r.seq, r.ts, r.kind, r.request_id, r.tenant, r.data, r.prev_hash, r.hash) for r in rows
            ],
            columns=["seq", "ts", "kind", "request_id", "tenant", "data", "prev_hash", "hash"],
        )
        if seal is not None and rows:
            await cls._add_sealed(conn, seal, rows[-1].seq, rows[-1].hash)
        return rows

    @staticmethod
    async def _add_sealed(conn: asyncpg.Connection, seal: Sealer, seq: int, head: str) -> None:
        r = await conn.fetchrow(CP_SELECT + " ORDER BY seq DESC LIMIT 1")
        cp = seal.seal(None if r is None else Checkpoint(*r), seq, head)
        if cp is not None:
            await conn.execute(CP_INSERT + "($1, $2, $3, $4, $5, $6, $7, $8)", *cp_values(cp))

    async def append_encoded(
        self, encode: Callable[[], list[Entry]], seal: Sealer | None = None
    ) -> list[Row]:
        entries = await asyncio.get_running_loop().run_in_executor(self._encoder, encode)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            return await self._insert(conn, entries, seal)

    async def seal_head(self, seal: Sealer) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            seal.admit(await self._tip(conn, seal), [])
            await self._add_sealed(conn, seal, *await self._head_in(conn))

    async def head(self) -> tuple[int, str]:
        async with self.pool.acquire() as conn:
            return await self._head_in(conn)

    async def rows(self, after_seq: int, limit: int) -> list[Row]:
        recs = await self.reads.fetch(_ROW + " WHERE seq > $1 ORDER BY seq LIMIT $2", after_seq, limit)
        return [Row(*r) for r in recs]

    async def search(self, query: AuditQuery, limit: int) -> list[Row]:
        sql, args = select(query, "postgres", _ROW, limit)
        return [Row(*r) for r in await self.reads.fetch(sql, *args)]

    async def seq_of_hash(self, digest: str) -> int | None:
        seq = await self.reads.fetchval("SELECT seq FROM audit_log WHERE hash = $1 LIMIT 1", digest)
        return None if seq is None else int(seq)

    async def checkpoints(self) -> list[Checkpoint]:
        return [Checkpoint(*r) for r in await self.reads.fetch(CP_SELECT + " ORDER BY seq")]

    async def cut_before(
        self, cutoff_ts: str, record: Callable[[Checkpoint], Entry], seal: Sealer
    ) -> Checkpoint | None:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            seal.admit(await self._tip(conn, seal), [])  # judged whole, before anything is deleted
            r = await conn.fetchrow(
                CP_SELECT + " WHERE seq = (" + NEWEST_BEFORE.format(param="$1") + ")", cutoff_ts
            )
            if r is None:
                return None
            cp = Checkpoint(*r)
            await conn.execute("DELETE FROM audit_log WHERE seq <= $1", cp.seq)
            await conn.execute("DELETE FROM audit_checkpoints WHERE seq < $1", cp.seq)
            await self._insert(conn, [record(cp)], seal, judged=True)
        return cp
