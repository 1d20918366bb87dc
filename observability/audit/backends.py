"""The audit store the settings name: PostgreSQL or SQLite.

Apart from the store's protocol (:mod:`.store`), which each backend implements: the factory imports
the backends, the backends import the protocol, and nothing imports back.
"""

from __future__ import annotations

from observability.audit.store import AuditStore
from observability.settings import AuditSettings


def build_store(settings: AuditSettings) -> AuditStore:
    if settings.store == "postgres":
        from observability.audit.postgres import PostgresStore

        assert settings.postgres_dsn is not None
        return PostgresStore(settings.postgres_dsn.get_secret_value())
    from observability.audit.sqlite import SQLiteStore

    return SQLiteStore(settings.sqlite_path)
