"""The audit chain on both real stores: every kind of tampering is found and named; retention stays verifiable."""

from __future__ import annotations

import asyncio
import base64
import itertools
import sqlite3
import subprocess
import sys

import asyncpg
import orjson
import pytest
from pydantic import SecretStr

from observability.audit.backends import build_store
from observability.audit.chain import Signer, link
from observability.audit.log import AuditLog
from observability.audit.verify import export_store, verify_store
from observability.metrics import Metrics
from observability.settings import AuditSettings
from tests.stores import fresh_pg_database

pytestmark = pytest.mark.timeout(120)

HMAC_KEY = "checkpoint-secret-for-tests"
ED_KEY = base64.b64encode(bytes(range(32))).decode()


class Raw:
    """Direct SQL on the store's database, the way someone tampering with it would go about it."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where

    async def __call__(self, sql: str, *args: object) -> None:
        if self.kind == "sqlite":
            db = sqlite3.connect(self.where, isolation_level=None)
            try:
                db.execute(sql, args)
            finally:
                db.close()
            return
        n = 0

        def repl(_: object) -> str:
            nonlocal n
            n += 1
            return f"${n}"

        import re

        conn = await asyncpg.connect(self.where)
        try:
            await conn.execute(re.sub(r"\?", repl, sql), *args)
        finally:
            await conn.close()

    async def rows(self) -> list[tuple]:
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


@pytest.fixture(params=["sqlite", "postgres"])
def store_settings(request, tmp_path):
    if request.param == "sqlite":
        path = tmp_path / "audit.db"
        yield (
            AuditSettings(store="sqlite", sqlite_path=path, checkpoint_every=5, signing={"key": HMAC_KEY}),
            Raw("sqlite", str(path)),
        )
    else:
        with fresh_pg_database() as dsn:
            yield (
                AuditSettings(
                    store="postgres", postgres_dsn=dsn, checkpoint_every=5, signing={"key": HMAC_KEY}
                ),
                Raw("postgres", dsn),
            )


async def _fill(settings: AuditSettings, n: int = 20) -> None:
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        for i in range(1, n + 1):
            assert await audit.append_event("test_event", {"n": i}) == i
    finally:
        await audit.aclose()


async def _verify(settings: AuditSettings):
    store = build_store(settings)
    await store.open()
    try:
        return await verify_store(store, Signer.from_settings(settings.signing))
    finally:
        await store.close()


async def test_untouched_chain_verifies_with_signed_checkpoints(store_settings):
    settings, _ = store_settings
    await _fill(settings)
    report = await _verify(settings)
    assert report.ok, report.problem
    assert (report.records, report.head_seq) == (20, 20)
    assert report.checkpoints_signed == 4  # at 5, 10, 15, 20
    assert report.covered_through == 20


async def test_edited_record_is_named(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("UPDATE audit_log SET data = replace(data, '\"n\":8}', '\"n\":80}') WHERE seq = ?", 8)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("edited", 8), p


async def test_edited_record_with_its_own_hash_recomputed_is_named(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    seq, prev, data, _ = (await raw.rows())[7]
    forged = data.replace('"n":8}', '"n":80}')
    await raw("UPDATE audit_log SET data = ?, hash = ? WHERE seq = ?", forged, link(prev, forged), seq)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("edited", 8), p


async def test_whole_chain_rewritten_after_an_edit_is_caught_at_the_next_checkpoint(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    rows = await raw.rows()
    prev = rows[6][3]  # hash of record 7
    for seq, _, data, _ in rows[7:]:
        if seq == 8:
            data = data.replace('"n":8}', '"n":80}')
        h = link(prev, data)
        await raw("UPDATE audit_log SET data = ?, prev_hash = ?, hash = ? WHERE seq = ?", data, prev, h, seq)
        prev = h
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("edited", 6), (
        p
    )  # records 6..10: the span the checkpoint at 10 no longer covers
    assert "6..10" in p.message


async def test_deleted_record_is_named(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("DELETE FROM audit_log WHERE seq = ?", 8)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("deleted", 8), p


async def test_reordered_records_are_named(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("UPDATE audit_log SET seq = -1 WHERE seq = ?", 8)
    await raw("UPDATE audit_log SET seq = 8 WHERE seq = ?", 9)
    await raw("UPDATE audit_log SET seq = 9 WHERE seq = ?", -1)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("reordered", 8), p
    assert "after record 9" in p.message


async def test_truncated_log_is_named(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("DELETE FROM audit_log WHERE seq > ?", 12)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("truncated", 13), p
    assert "13..20" in p.message


async def test_records_deleted_from_the_start_without_an_anchor(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("DELETE FROM audit_log WHERE seq <= ?", 3)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("deleted", 1), p


async def test_forged_checkpoint_fails_its_signature(store_settings):
    settings, raw = store_settings
    await _fill(settings)
    await raw("UPDATE audit_checkpoints SET hash = ? WHERE seq = ?", "f" * 64, 10)
    p = (await _verify(settings)).problem
    assert (p.kind, p.seq) == ("bad_signature", 10), p


async def test_retention_cut_keeps_the_chain_verifiable(store_settings):
    settings, _ = store_settings
    await _fill(settings, 12)  # checkpoints at 5, 10 and (on close) 12
    settings = settings.model_copy(update={"retention_days": 1e-9})
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        # One cut, made here: the background pass (every second at this retention) would cut again, up to
        # the signed retention_cut record of this one, whenever the machine is slow.
        audit._retention.cancel()
        anchor = await audit.retain()
        assert anchor is not None and anchor.seq == 12
        for i in range(3):
            await audit.append_event("test_event", {"after_cut": i})
    finally:
        await audit.aclose()
    report = await _verify(settings)
    assert report.ok, report.problem
    assert report.anchored_at == anchor.seq
    # the retention_cut record, then three more
    assert (report.first_seq, report.head_seq) == (anchor.seq + 1, anchor.seq + 4)


async def test_ed25519_checkpoints_verify_with_the_public_key_alone(tmp_path):
    settings = AuditSettings(
        sqlite_path=tmp_path / "a.db",
        checkpoint_every=4,
        signing={"algorithm": "ed25519", "key": ED_KEY, "key_id": "k1"},
    )
    await _fill(settings, 8)
    public = Signer.from_settings(settings.signing).public_key_b64()
    verifier_only = settings.signing.model_copy(update={"key": None})
    store = build_store(settings)
    await store.open()
    try:
        report = await verify_store(store, Signer.from_settings(verifier_only, public))
        assert report.ok and report.checkpoints_signed == 2  # at 4 and 8
        other = base64.b64encode(bytes(range(1, 33))).decode()
        wrong = Signer.from_settings(
            settings.signing.model_copy(update={"key": None}),
            Signer.from_settings(
                settings.signing.model_copy(update={"key": SecretStr(other)})
            ).public_key_b64(),
        )
        bad = await verify_store(store, wrong)
        assert bad.problem is not None and bad.problem.kind == "bad_signature"
    finally:
        await store.close()


async def test_export_writes_verifiable_json_lines(tmp_path):
    settings = AuditSettings(sqlite_path=tmp_path / "a.db", signing={"key": HMAC_KEY})
    await _fill(settings, 5)
    store = build_store(settings)
    await store.open()
    out = tmp_path / "export.jsonl"
    try:
        with out.open("wb") as f:
            assert await export_store(store, f, after_seq=2) == 3
    finally:
        await store.close()
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["seq"] for r in lines] == [3, 4, 5]
    for a, b in itertools.pairwise(lines):
        assert b["prev_hash"] == a["hash"]
    assert lines[0]["data"]["payload"] == {"n": 3}


def test_cli_verify_names_the_record_and_sets_the_exit_status(tmp_path):
    settings = AuditSettings(sqlite_path=tmp_path / "a.db", checkpoint_every=5, signing={"key": HMAC_KEY})
    asyncio.run(_fill(settings, 10))
    cfg = tmp_path / "omnigate.yaml"
    cfg.write_text(f"audit:\n  sqlite_path: {tmp_path / 'a.db'}\n  signing:\n    key: {HMAC_KEY}\n")
    cli = [sys.executable, "-m", "gateway.cli", "audit"]
    ok = subprocess.run([*cli, "verify", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "audit chain OK: 10 records" in ok.stdout and "2 signed checkpoints verified" in ok.stdout
    db = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    db.execute("DELETE FROM audit_log WHERE seq = 4")
    db.close()
    bad = subprocess.run([*cli, "verify", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "BROKEN at record 4 (deleted)" in bad.stdout
    exported = subprocess.run(
        [*cli, "export", "--sqlite", str(tmp_path / "a.db")], capture_output=True, timeout=60
    )
    assert exported.returncode == 0 and len(exported.stdout.splitlines()) == 9
