"""The PostgreSQL directory (asyncpg): the tenants and keys every replica reads."""

from __future__ import annotations

from typing import Any

import asyncpg

from gateway.directory.store import SCHEMA
from gateway.tenants import KeyEntry

_SCHEMA = SCHEMA.format(int_type="BIGINT", bool_type="BOOLEAN")
_LOCK = 0x6F6D6E6964697221  # "omnidir!": serialises schema creation between replicas booting together


class PostgresDirectory:
    name = "postgres"
    shared = True

    def __init__(self, dsn: str, timeout_s: float) -> None:
        self.dsn = dsn
        self.timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=4, command_timeout=self.timeout_s
        )
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            await conn.execute(_SCHEMA)
            await conn.execute(
                "INSERT INTO omnigate_directory_revision (id, revision) VALUES (1, 0) "
                "ON CONFLICT (id) DO NOTHING"
            )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the directory store is not open")
        return self._pool

    async def revision(self) -> int:
        return int(await self.pool.fetchval("SELECT revision FROM omnigate_directory_revision WHERE id = 1"))

    async def load(self) -> tuple[int, list[str], list[KeyEntry]]:
        # One snapshot: the revision read matches the rows read with it.
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            rev = await conn.fetchval("SELECT revision FROM omnigate_directory_revision WHERE id = 1")
            tenants = [r[0] for r in await conn.fetch("SELECT config FROM omnigate_tenants ORDER BY name")]
            keys = [
                KeyEntry(r[0], r[1], r[2], bool(r[3]), "admin", r[4])
                for r in await conn.fetch(
                    "SELECT id, tenant, sha256, enabled, created_at FROM omnigate_api_keys ORDER BY id"
                )
            ]
        return int(rev), tenants, keys

    async def _write(self, sql: str, *args: Any) -> str:
        async with self.pool.acquire() as conn, conn.transaction():
            status = await conn.execute(sql, *args)
            await conn.execute("UPDATE omnigate_directory_revision SET revision = revision + 1 WHERE id = 1")
        return str(status)

    async def put_tenant(self, name: str, config_json: str, now: str) -> None:
        await self._write(
            "INSERT INTO omnigate_tenants (name, config, updated_at) VALUES ($1, $2, $3) "
            "ON CONFLICT (name) DO UPDATE SET config = EXCLUDED.config, updated_at = EXCLUDED.updated_at",
            name,
            config_json,
            now,
        )

    async def add_key(self, key: KeyEntry, created_by: str) -> None:
        await self._write(
            "INSERT INTO omnigate_api_keys (id, tenant, sha256, enabled, created_at, created_by) "
            "VALUES ($1, $2, $3, $4, $5, $6)",
            key.id,
            key.tenant,
            key.sha256,
            key.enabled,
            key.created_at,
            created_by,
        )

    async def set_key_enabled(self, key_id: str, enabled: bool) -> bool:
        status = await self._write("UPDATE omnigate_api_keys SET enabled = $1 WHERE id = $2", enabled, key_id)
        return status.endswith(" 1")
