"""The SQLite directory: one process's tenants and keys (WAL, each commit fsynced, one worker thread)."""

from __future__ import annotations

from typing import Any

from gateway.directory.store import SCHEMA
from gateway.tenants import KeyEntry
from observability.sqlite_worker import SQLiteWorker

_SCHEMA = SCHEMA.format(int_type="INTEGER", bool_type="INTEGER")


class SQLiteDirectory(SQLiteWorker):
    name = "sqlite"
    shared = False
    what = "directory"

    def _open(self) -> None:
        db = self._connect(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO omnigate_directory_revision (id, revision) VALUES (1, 0)")
        self._db = db

    def _revision(self) -> int:
        return int(
            self.db.execute("SELECT revision FROM omnigate_directory_revision WHERE id = 1").fetchone()[0]
        )

    async def revision(self) -> int:
        return await self._run(self._revision)

    def _load(self) -> tuple[int, list[str], list[KeyEntry]]:
        db = self.db
        db.execute("BEGIN")
        try:
            rev = self._revision()
            tenants = [r[0] for r in db.execute("SELECT config FROM omnigate_tenants ORDER BY name")]
            keys = [
                KeyEntry(r[0], r[1], r[2], bool(r[3]), "admin", r[4])
                for r in db.execute(
                    "SELECT id, tenant, sha256, enabled, created_at FROM omnigate_api_keys ORDER BY id"
                )
            ]
        finally:
            db.execute("COMMIT")
        return rev, tenants, keys

    async def load(self) -> tuple[int, list[str], list[KeyEntry]]:
        return await self._run(self._load)

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        def q() -> int:
            n = self.db.execute(sql, args).rowcount
            self.db.execute("UPDATE omnigate_directory_revision SET revision = revision + 1 WHERE id = 1")
            return n

        return self._locked(q)

    async def put_tenant(self, name: str, config_json: str, now: str) -> None:
        await self._run(
            self._write,
            "INSERT INTO omnigate_tenants (name, config, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET config = excluded.config, updated_at = excluded.updated_at",
            (name, config_json, now),
        )

    async def add_key(self, key: KeyEntry, created_by: str) -> None:
        await self._run(
            self._write,
            "INSERT INTO omnigate_api_keys (id, tenant, sha256, enabled, created_at, created_by) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key.id, key.tenant, key.sha256, int(key.enabled), key.created_at, created_by),
        )

    async def set_key_enabled(self, key_id: str, enabled: bool) -> bool:
        return (
            await self._run(
                self._write, "UPDATE omnigate_api_keys SET enabled = ? WHERE id = ?", (int(enabled), key_id)
            )
            > 0
        )
