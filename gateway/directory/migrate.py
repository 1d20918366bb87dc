"""``omnigate directory import``: copy the tenants and keys an older gateway kept in its audit database.

Earlier versions stored admin-made tenants and keys in the audit store's ``tenants`` and
``api_keys`` tables. The gateway no longer reads them there; this copies them once into the
tenant directory (existing names and key ids are left as they are) and says what it did.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from core.settings import TenantConfig
from gateway.settings import Settings
from gateway.tenants import KeyEntry


@dataclass(frozen=True, slots=True)
class Imported:
    tenants: int
    keys: int
    skipped: int


async def _legacy_rows(settings: Settings) -> tuple[list[tuple[str, str, str]], list[tuple[Any, ...]]]:
    audit = settings.audit
    if audit.store == "postgres":
        import asyncpg

        assert audit.postgres_dsn is not None
        conn = await asyncpg.connect(audit.postgres_dsn.get_secret_value())
        try:
            if await conn.fetchval("SELECT to_regclass('tenants')") is None:
                return [], []
            tenants = [tuple(r) for r in await conn.fetch("SELECT name, config, updated_at FROM tenants")]
            keys = [
                tuple(r)
                for r in await conn.fetch("SELECT id, tenant, sha256, enabled, created_at FROM api_keys")
            ]
        finally:
            await conn.close()
        return tenants, keys
    if not audit.sqlite_path.is_file():
        return [], []
    db = sqlite3.connect(audit.sqlite_path)
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "tenants" not in names:
            return [], []
        tenants = list(db.execute("SELECT name, config, updated_at FROM tenants"))
        keys = list(db.execute("SELECT id, tenant, sha256, enabled, created_at FROM api_keys"))
    finally:
        db.close()
    return tenants, keys


async def import_from_audit(settings: Settings) -> Imported:
    from gateway.directory.backends import build_store

    tenants, keys = await _legacy_rows(settings)
    store = build_store(settings.auth.directory)
    await store.open()
    try:
        _, have_tenants, have_keys = await store.load()
        known = {TenantConfig.model_validate_json(t).name for t in have_tenants}
        known_keys = {k.id for k in have_keys}
        done_t = done_k = skipped = 0
        for name, config, updated_at in tenants:
            if name in known:
                skipped += 1
                continue
            TenantConfig.model_validate_json(config)  # a row that no longer validates stops the import
            await store.put_tenant(name, config, updated_at)
            done_t += 1
        for key_id, tenant, sha256, enabled, created_at in keys:
            if key_id in known_keys:
                skipped += 1
                continue
            await store.add_key(
                KeyEntry(key_id, tenant, sha256, bool(enabled), "admin", created_at), "import"
            )
            done_k += 1
    finally:
        await store.close()
    return Imported(done_t, done_k, skipped)
