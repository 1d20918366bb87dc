"""What a directory store does. Every write bumps one revision number in the same transaction,
so a replica finds out that something changed with one cheap read."""

from __future__ import annotations

from typing import Protocol

from gateway.tenants import KeyEntry

#: table names of their own, so the directory may share a database with the audit trail
SCHEMA = """
CREATE TABLE IF NOT EXISTS omnigate_directory_revision (id INTEGER PRIMARY KEY, revision {int_type} NOT NULL);
CREATE TABLE IF NOT EXISTS omnigate_tenants (
    name TEXT PRIMARY KEY, config TEXT NOT NULL, updated_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS omnigate_api_keys (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, sha256 TEXT NOT NULL, enabled {bool_type} NOT NULL,
    created_at TEXT NOT NULL, created_by TEXT);
"""


class DirectoryStore(Protocol):
    name: str
    #: True when every replica reads the same store
    shared: bool

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def revision(self) -> int:
        """A number that changes with every write (cheap: read it before re-reading everything)."""
        ...

    async def load(self) -> tuple[int, list[str], list[KeyEntry]]:
        """The revision, the tenants' configs (JSON) and the keys, read in one transaction."""
        ...

    async def put_tenant(self, name: str, config_json: str, now: str) -> None: ...

    async def add_key(self, key: KeyEntry, created_by: str) -> None: ...

    async def set_key_enabled(self, key_id: str, enabled: bool) -> bool: ...
