"""The SQLite directory: one process's tenants and keys (WAL, each commit fsynced, one worker thread)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gateway.directory.store import SCHEMA
from gateway.tenants import KeyEntry

T = TypeVar("T")
_SCHEMA = SCHEMA.format(int_type="INTEGER", bool_type="INTEGER")


class SQLiteDirectory:
    name = "sqlite"
    shared = False

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="directory-sqlite")
        self._db: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO omnigate_directory_revision (id, revision) VALUES (1, 0)")
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
            raise RuntimeError("the directory store is not open")
        return self._db

    def _revision(self) -> int:
        return int(self.db.execute("SELECT revision FROM omnigate_directory_revision WHERE id = 1").fetchone()[0])

    async def revision(self) -> int:
        return await self._run(self._revision)

    def _load(self) -> tuple[int, list[str], list[KeyEntry]]:
        db = self.db
        db.execute("BEGIN")
        try:
            rev = self._revision()
            tenants = [r[0] for r in db.execute("SELECT config FROM omnigate_tenants ORDER BY name")]
            keys = [KeyEntry(r[0], r[1], r[2], bool(r[3]), "admin", r[4]) for r in db.execute(
                "SELECT id, tenant, sha256, enabled, created_at FROM omnigate_api_keys ORDER BY id")]
        finally:
            db.execute("COMMIT")
        return rev, tenants, keys

    async def load(self) -> tuple[int, list[str], list[KeyEntry]]:
        return await self._run(self._load)

    def _write(self, sql: str, args: tuple[Any, ...]) -> int:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            n = db.execute(sql, args).rowcount
            db.execute("UPDATE omnigate_directory_revision SET revision = revision + 1 WHERE id = 1")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return n

    async def put_tenant(self, name: str, config_json: str, now: str) -> None:
        await self._run(self._write,
                        "INSERT INTO omnigate_tenants (name, config, updated_at) VALUES (?, ?, ?) "
                        "ON CONFLICT (name) DO UPDATE SET config = excluded.config, updated_at = excluded.updated_at",
                        (name, config_json, now))

    async def add_key(self, key: KeyEntry, created_by: str) -> None:
        await self._run(self._write,
                        "INSERT INTO omnigate_api_keys (id, tenant, sha256, enabled, created_at, created_by) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (key.id, key.tenant, key.sha256, int(key.enabled), key.created_at, created_by))

    async def set_key_enabled(self, key_id: str, enabled: bool) -> bool:
        return await self._run(self._write, "UPDATE omnigate_api_keys SET enabled = ? WHERE id = ?",
                               (int(enabled), key_id)) > 0
