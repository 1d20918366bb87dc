"""Forge and delete: edit a record, re-link every later hash, ``DELETE FROM audit_checkpoints``.

The chain is then consistent in itself and no checkpoint contradicts it. Its first
record states, signed, the cadence it is checkpointed at, so the missing checkpoints
are a gap: ``omnigate audit verify`` exits 1, ``GET /admin/audit/verify`` answers 409,
a live gateway refuses to append to (and so to sign) the forged chain, and a gateway
does not start on it. On SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

import asyncpg
import orjson
import pytest
import yaml

from core.errors import AuditUnavailable
from observability.audit.backends import build_store
from observability.audit.chain import GENESIS, link
from observability.audit.log import AuditLog
from observability.metrics import Metrics
from observability.settings import AuditSettings
from tests.console_setup import SIGNING_KEY, admin, chat, config, start, tenant_keys
from tests.stores import fresh_pg_database

pytestmark = pytest.mark.timeout(180)

KEY = "forgery-checkpoint-secret-3c9d51e0b7a2"


class Tamper:
    """The store's tables, rewritten with plain SQL by someone with write access and no signing key."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where

    async def _rows(self) -> list[tuple]:
        sql = "SELECT seq, prev_hash, data, hash FROM audit_log ORDER BY seq"
        if self.kind == "sqlite":
            db = sqlite3.connect(self.where)
            try:
                return db.execute(sql).fetchall()
            finally:
                db.close()
        conn = await asyncpg.connect(self.where)
        try:
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()

    async def checkpoints(self) -> int:
        sql = "SELECT COUNT(*) FROM audit_checkpoints"
        if self.kind == "sqlite":
            db = sqlite3.connect(self.where)
            try:
                return int(db.execute(sql).fetchone()[0])
            finally:
                db.close()
        conn = await asyncpg.connect(self.where)
        try:
            return int(await conn.fetchval(sql))
        finally:
            await conn.close()

    async def forge(self, seq: int) -> None:
        """Rewrite record ``seq``'s payload, re-link every later record, delete every checkpoint."""
        rows = await self._rows()
        updates = []
        prev = GENESIS
        for s, _old_prev, data, _old_hash in rows:
            if s == seq:
                doc = orjson.loads(data)
                doc["payload"] = {"forged": True}
                data = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode()
            h = link(prev, data)
            updates.append((data, prev, h, s))
            prev = h
        sql = "UPDATE audit_log SET data = ?, prev_hash = ?, hash = ? WHERE seq = ?"
        if self.kind == "sqlite":
            db = sqlite3.connect(self.where, isolation_level=None, timeout=30)
            try:
                db.execute("BEGIN IMMEDIATE")
                db.executemany(sql, updates)
                db.execute("DELETE FROM audit_checkpoints")
                db.execute("COMMIT")
            finally:
                db.close()
            return
        conn = await asyncpg.connect(self.where)
        try:
            async with conn.transaction():
                await conn.executemany(
                    "UPDATE audit_log SET data = $1, prev_hash = $2, hash = $3 WHERE seq = $4", updates
                )
                await conn.execute("DELETE FROM audit_checkpoints")
        finally:
            await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    common = {"checkpoint_every": 4, "signing": {"key": KEY}}
    if request.param == "sqlite":
        path = tmp_path / "audit.db"
        yield AuditSettings(store="sqlite", sqlite_path=path, **common), Tamper("sqlite", str(path))
    else:
        with fresh_pg_database("omnigate_forgery") as dsn:
            yield AuditSettings(store="postgres", postgres_dsn=dsn, **common), Tamper("postgres", dsn)


async def _fill(settings: AuditSettings, n: int) -> None:
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        for i in range(1, n + 1):
            assert await audit.append_event("test_event", {"n": i}) is not None
    finally:
        await audit.aclose()


def _cli_verify(settings: AuditSettings, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    audit: dict[str, object] = {"checkpoint_every": 4, "signing": {"key": KEY}}
    if settings.store == "sqlite":
        audit["sqlite_path"] = str(settings.sqlite_path)
    else:
        assert settings.postgres_dsn is not None
        audit.update(store="postgres", postgres_dsn=settings.postgres_dsn.get_secret_value())
    cfg = tmp_path / "verify.yaml"
    cfg.write_text(yaml.safe_dump({"audit": audit}))
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "audit", "verify", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_verify_fails_a_forged_chain_whose_checkpoints_were_deleted(store, tmp_path):
    settings, tamper = store
    asyncio.run(_fill(settings, 20))
    ok = _cli_verify(settings, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    asyncio.run(tamper.forge(7))
    assert asyncio.run(tamper.checkpoints()) == 0
    bad = _cli_verify(settings, tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "BROKEN" in bad.stdout and "checkpoint" in bad.stdout, bad.stdout


def test_a_forged_young_chain_without_its_statement_fails_too(store, tmp_path):
    """Fewer records than the cadence: no checkpoint is due yet, but the forger cannot re-sign record 1."""
    settings, tamper = store
    asyncio.run(_fill(settings, 3))
    asyncio.run(tamper.forge(1))
    bad = _cli_verify(settings, tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr


def test_a_gateway_started_on_a_forged_chain_appends_and_signs_nothing(store):
    settings, tamper = store
    asyncio.run(_fill(settings, 20))
    asyncio.run(tamper.forge(7))

    async def restart() -> int:
        audit = AuditLog(settings, build_store(settings), Metrics())
        await audit.start()  # starts (the admin API must show the break), refusing the chain
        try:
            assert audit.broken and "checkpoint" in str(audit.guard.broken)
            with pytest.raises(AuditUnavailable):
                audit.admit()  # a request is refused before it is served
            audit.submit("request", request_id="after-forgery", payload={"outcome": "served"})
            head = await audit.store.head()
        finally:
            await audit.aclose()  # and the stop signs nothing on top of it
        return head[0]

    async def head_of() -> int:
        store = build_store(settings)
        await store.open()
        try:
            return (await store.head())[0]
        finally:
            await store.close()

    before = asyncio.run(head_of())
    assert asyncio.run(restart()) == before  # nothing appended
    assert asyncio.run(tamper.checkpoints()) == 0  # nothing signed on top of the forged chain


@pytest.fixture(params=["sqlite", "postgres"])
def live(request, bg, eng, tmp_path):
    keys = tenant_keys()
    audit: dict[str, object] = {"checkpoint_every": 4, "signing": {"key": SIGNING_KEY}}
    if request.param == "postgres":
        with fresh_pg_database("omnigate_forgery") as dsn:
            audit.update(store="postgres", postgres_dsn=dsn)
            server = start(bg, config(eng, tmp_path, keys, audit=audit), tmp_path / "omnigate.yaml")
            yield server, keys, Tamper("postgres", dsn)
            server.stop()
    else:
        path = tmp_path / "audit.db"
        audit["sqlite_path"] = str(path)
        server = start(bg, config(eng, tmp_path, keys, audit=audit), tmp_path / "omnigate.yaml")
        yield server, keys, Tamper("sqlite", str(path))
        server.stop()


def test_a_live_gateway_refuses_to_sign_on_top_of_a_forged_chain(live, bg):
    server, keys, tamper = live
    for _ in range(10):
        assert chat(server, keys["acme"].key).status_code == 200
    assert admin(server, "GET", "/audit/verify").status_code == 200
    bg.run(tamper.forge(3))

    verify = admin(server, "GET", "/audit/verify")
    assert verify.status_code == 409, verify.text
    assert verify.json()["problem"]["kind"] == "checkpoint_gap", verify.text

    # The next request's record would extend the forged chain: refused, and the clients are told so.
    for _ in range(3):
        r = chat(server, keys["acme"].key)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "audit_unavailable", r.text
    server.stop()  # a stop seals the head: not this one
    assert bg.run(tamper.checkpoints()) == 0
