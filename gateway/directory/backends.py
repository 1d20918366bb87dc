"""The directory store the settings name: PostgreSQL (shared by every replica) or SQLite (this process's).

Apart from the store's protocol (:mod:`.store`), which each backend implements: the factory imports
the backends, the backends import the protocol, and nothing imports back.
"""

from __future__ import annotations

from gateway.auth_settings import DirectorySettings
from gateway.directory.store import DirectoryStore


def build_store(settings: DirectorySettings) -> DirectoryStore:
    if settings.backend == "postgres":
        from gateway.directory.postgres import PostgresDirectory

        assert settings.postgres_dsn is not None
        return PostgresDirectory(settings.postgres_dsn.get_secret_value(), settings.timeout_s)
    from gateway.directory.sqlite import SQLiteDirectory

    assert settings.sqlite_path is not None  # Settings fills it in beside the audit database
    return SQLiteDirectory(settings.sqlite_path)
