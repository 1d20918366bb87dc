"""``audit verify`` is evidence: the attacks of someone with write access to the store are caught.

The three attacks the former verifier accepted, then a mutation test: every single
edit, deletion, insertion, reordering or truncation of the records or checkpoints of
a generated chain, applied with SQL to a real store (SQLite and PostgreSQL), must
make ``verify`` fail, given the head the gateway published outside the store.
"""

from __future__ import annotations

import base64
import dataclasses
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import asyncpg
import orjson
import pytest

from observability.audit.backends import build_store
from observability.audit.chain import GENESIS, Checkpoint, Signer, link
from observability.audit.log import AuditLog
from observability.audit.verify import verify_store
from observability.audit.witness import read_heads
from observability.metrics import Metrics
from observability.settings import AuditSettings
from tests.stores import fresh_pg_database

pytestmark = pytest.mark.timeout(300)

KEY = "evidence-checkpoint-secret-9f3b2c71d0"
OTHER_KEY = "another-checkpoint-secret-55e0aa13c2"

RowT = tuple  # (seq, ts, kind, request_id, tenant, data, prev_hash, hash)
CpT = tuple  # (seq, hash, created_at, algorithm, key_id, signature, prev_cp, cadence)


class Tables:
    """The store's two chain tables, read and rewritten wholesale with SQL (as a tamperer would)."""

    def __init__(self, kind: str, where: str) -> None:
        self.kind, self.where = kind, where

    async def _exec(self, statements: list[tuple[str, list[tuple]]], fetch: str | None = None):
        if self.kind == "sqlite":
            db = sqlite3.connect(self.where, isolation_level=None)
            try:
                if fetch:
                    return db.execute(fetch).fetchall()
                db.execute("BEGIN")
                for sql, rows in statements:
                    if "?" not in sql:
                        db.execute(sql)
                    elif rows:
                        db.executemany(sql, rows)
                db.execute("COMMIT")
            finally:
                db.close()
            return None
        conn = await asyncpg.connect(self.where)
        try:
            if fetch:
                return [tuple(r) for r in await conn.fetch(fetch)]
            async with conn.transaction():
                for sql, rows in statements:
                    n = sql.count("?")
                    pg = sql
                    for i in range(1, n + 1):
                        pg = pg.replace("?", f"${i}", 1)
                    if n == 0:
                        await conn.execute(pg)
                    elif rows:
                        await conn.executemany(pg, rows)
        finally:
            await conn.close()
        return None

    async def read(self) -> tuple[list[RowT], list[CpT]]:
        rows = await self._exec(
            [], "SELECT seq, ts, kind, request_id, tenant, data, prev_hash, hash FROM audit_log ORDER BY seq"
        )
        cps = await self._exec(
            [],
            "SELECT seq, hash, created_at, algorithm, key_id, signature, prev_cp, cadence "
            "FROM audit_checkpoints ORDER BY seq",
        )
        return rows, cps

    async def write(self, rows: list[RowT], cps: list[CpT]) -> None:
        await self._exec(
            [
                ("DELETE FROM audit_log", []),
                ("DELETE FROM audit_checkpoints", []),
                (
                    "INSERT INTO audit_log (seq, ts, kind, request_id, tenant, data, prev_hash, hash) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [tuple(r) for r in rows],
                ),
                (
                    "INSERT INTO audit_checkpoints (seq, hash, created_at, algorithm, key_id, signature, prev_cp, "
                    "cadence) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [tuple(c) for c in cps],
                ),
            ]
        )


@pytest.fixture(params=["sqlite", "postgres"])
def chain_store(request, tmp_path):
    witness = tmp_path / "heads.jsonl"
    common = {"checkpoint_every": 4, "signing": {"key": KEY}, "witness_path": witness}
    if request.param == "sqlite":
        path = tmp_path / "audit.db"
        yield AuditSettings(store="sqlite", sqlite_path=path, **common), Tables("sqlite", str(path))
    else:
        with fresh_pg_database("omnigate_evidence") as dsn:
            yield AuditSettings(store="postgres", postgres_dsn=dsn, **common), Tables("postgres", dsn)


async def _fill(settings: AuditSettings, n: int) -> None:
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        for i in range(1, n + 1):
            assert await audit.append_event("test_event", {"n": i}) == i
    finally:
        await audit.aclose()


async def _verify(settings: AuditSettings, store=None, **kw):
    own = store is None
    if own:
        store = build_store(settings)
        await store.open()
    try:
        return await verify_store(store, Signer.from_settings(settings.signing), **kw)
    finally:
        if own:
            await store.close()


def _relink(rows: list[RowT], start: int = 0) -> list[RowT]:
    """Recompute every hash from ``rows[start]`` on, so the chain is consistent in itself."""
    out = [list(r) for r in rows]
    for i in range(start, len(out)):
        prev = out[i - 1][7] if i else GENESIS
        out[i][6] = prev
        out[i][7] = link(prev, out[i][5])
    return [tuple(r) for r in out]


def _edit_payload(row: RowT, n: int) -> RowT:
    doc = orjson.loads(row[5])
    doc["payload"] = {"n": n}
    return (*row[:5], orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode(), *row[6:])


# -- the three attacks the former verifier accepted ------------------------------------------------------


async def test_tail_deleted_with_its_checkpoints_is_caught_by_the_published_head(chain_store):
    settings, tables = chain_store
    await _fill(settings, 20)
    heads = read_heads(settings.witness_path)
    assert sorted(heads) == [4, 8, 12, 16, 20]  # every signed head was published outside the store
    rows, cps = await tables.read()
    await tables.write(rows[:12], [c for c in cps if c[0] <= 12])
    assert (await _verify(settings)).ok  # consistent in itself: only the witness can tell
    p = (await _verify(settings, expect=heads)).problem
    assert p is not None and (p.kind, p.seq) == ("truncated", 13), p


async def test_record_rewritten_and_relinked_after_dropping_later_checkpoints_is_a_cadence_gap(chain_store):
    settings, tables = chain_store
    await _fill(settings, 20)
    rows, cps = await tables.read()
    rows[7] = _edit_payload(rows[7], 80)
    await tables.write(_relink(rows, 7), [c for c in cps if c[0] < 8])
    p = (await _verify(settings)).problem
    assert p is not None and p.kind == "checkpoint_gap" and p.seq == 5, p


async def test_prefix_cut_behind_a_forged_unsigned_checkpoint_is_refused(chain_store):
    settings, tables = chain_store
    await _fill(settings, 20)
    rows, cps = await tables.read()
    anchor = rows[11]
    forged = (12, anchor[7], "2026-01-01T00:00:00.000000Z", "none", "default", "", GENESIS, 4)
    await tables.write(rows[12:], [forged] + [c for c in cps if c[0] > 12])
    p = (await _verify(settings)).problem
    assert p is not None and p.kind == "unsigned" and p.seq == 12, p


async def test_prefix_cut_behind_a_genuine_checkpoint_without_a_retention_record_is_refused(chain_store):
    settings, tables = chain_store
    await _fill(settings, 20)
    rows, cps = await tables.read()
    await tables.write(rows[12:], [c for c in cps if c[0] >= 12])
    p = (await _verify(settings)).problem
    assert p is not None and (p.kind, p.seq) == ("deleted", 1) and "retention_cut" in p.message, p


async def test_checkpoints_signed_by_another_key_are_refused(chain_store):
    settings, _ = chain_store
    await _fill(settings, 8)
    other = settings.model_copy(
        update={
            "signing": settings.signing.model_copy(update={"key_id": "other", "key": settings.signing.key})
        }
    )
    p = (await _verify(other)).problem
    assert p is not None and p.kind == "unsigned" and "another key" in p.message, p


async def test_checkpoints_keep_the_cadence_across_replicas_sharing_the_store(chain_store):
    settings, _ = chain_store
    a = AuditLog(settings, build_store(settings), Metrics())
    b = AuditLog(settings, build_store(settings), Metrics())
    await a.start()
    await b.start()
    try:
        for i in range(15):
            await (a if i % 2 else b).append_event("test_event", {"n": i})
    finally:
        await a.aclose()
        await b.aclose()
    report = await _verify(settings, require_covered=True, expect=read_heads(settings.witness_path))
    assert report.ok, report.problem
    store = build_store(settings)
    await store.open()
    try:
        assert [c.seq for c in await store.checkpoints()][:3] == [4, 8, 12]
    finally:
        await store.close()


async def test_retention_writes_a_signed_cut_record_and_still_verifies(chain_store):
    settings, tables = chain_store
    await _fill(settings, 10)
    cut = settings.model_copy(update={"retention_days": 1e-9})
    audit = AuditLog(cut, build_store(cut), Metrics())
    await audit.start()
    try:
        anchor = await audit.retain()
        assert anchor is not None and anchor.seq == 10  # the head was sealed on close
    finally:
        await audit.aclose()
    report = await _verify(settings, require_covered=True)
    assert report.ok, report.problem
    # The background retention loop (every second at this setting) may cut once more under load, at the
    # first cut's own record: either way the remaining chain is anchored by a signed cut.
    assert report.anchored_at in (10, 11)
    rows, cps = await tables.read()
    assert rows[0][2] == "retention_cut" and cps[-1][0] == rows[0][0]  # the cut record is signed at once


def test_cli_verify_expect_and_expect_file(tmp_path):
    witness = tmp_path / "heads.jsonl"
    db_path = tmp_path / "a.db"
    settings = AuditSettings(
        sqlite_path=db_path, checkpoint_every=4, signing={"key": KEY}, witness_path=witness
    )
    import asyncio

    asyncio.run(_fill(settings, 12))
    cfg = tmp_path / "omnigate.yaml"
    cfg.write_text(f"audit:\n  sqlite_path: {db_path}\n  checkpoint_every: 4\n  signing:\n    key: {KEY}\n")
    cli = [sys.executable, "-m", "gateway.cli", "audit", "verify", "--config", str(cfg)]
    head = read_heads(witness)[12]
    ok = subprocess.run(
        [*cli, "--expect-file", str(witness), "--require-covered"], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("DELETE FROM audit_log WHERE seq > 8")
    db.execute("DELETE FROM audit_checkpoints WHERE seq > 8")
    db.close()
    assert subprocess.run(cli, capture_output=True, timeout=60).returncode == 0  # nothing else can tell
    bad = subprocess.run([*cli, "--expect", f"12:{head}"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "BROKEN at record 9 (truncated)" in bad.stdout, bad.stdout
    wrong = subprocess.run([*cli, "--expect", "12:nothex"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "SEQ:HASH" in wrong.stderr


# -- mutation test -----------------------------------------------------------------------------------------

Mutation = Callable[[list[RowT], list[CpT]], tuple[list[RowT], list[CpT]]]


def _mutations(rows: list[RowT], cps: list[CpT]) -> dict[str, Mutation]:
    n = len(rows)
    out: dict[str, Mutation] = {}
    other = Signer("hmac-sha256", "default", OTHER_KEY.encode())

    def put(name: str, fn: Mutation) -> None:
        out[name] = fn

    for i in range(n):
        seq = i + 1
        for col, value in (
            (1, "2020-01-01T00:00:00.000000Z"),
            (2, "forged"),
            (3, "rid"),
            (4, "tenant-x"),
            (6, "a" * 64),
            (7, "b" * 64),
        ):
            put(
                f"record {seq}: column {col} edited",
                lambda r, c, i=i, col=col, value=value: (
                    [*r[:i], (*r[i][:col], value, *r[i][col + 1 :]), *r[i + 1 :]],
                    c,
                ),
            )
        put(
            f"record {seq}: payload edited",
            lambda r, c, i=i: ([*r[:i], _edit_payload(r[i], 999), *r[i + 1 :]], c),
        )
        put(
            f"record {seq}: payload edited, chain relinked",
            lambda r, c, i=i: (_relink([*r[:i], _edit_payload(r[i], 999), *r[i + 1 :]], i), c),
        )
        put(f"record {seq}: deleted", lambda r, c, i=i: ([*r[:i], *r[i + 1 :]], c))
        put(
            f"record {seq}: deleted, later renumbered and relinked",
            lambda r, c, i=i: (_relink([*r[:i], *[(x[0] - 1, *x[1:]) for x in r[i + 1 :]]], i), c),
        )
        put(
            f"record inserted after {seq}, later renumbered and relinked",
            lambda r, c, i=i: (
                _relink(
                    [
                        *r[: i + 1],
                        (r[i][0] + 1, *_edit_payload(r[i], 555)[1:]),
                        *[(x[0] + 1, *x[1:]) for x in r[i + 1 :]],
                    ],
                    i + 1,
                ),
                c,
            ),
        )
        if i + 1 < n:
            put(
                f"records {seq} and {seq + 1} swapped",
                lambda r, c, i=i: (
                    [*r[:i], (r[i][0], *r[i + 1][1:]), (r[i + 1][0], *r[i][1:]), *r[i + 2 :]],
                    c,
                ),
            )
            put(
                f"records {seq} and {seq + 1} swapped, relinked",
                lambda r, c, i=i: (
                    _relink([*r[:i], (r[i][0], *r[i + 1][1:]), (r[i + 1][0], *r[i][1:]), *r[i + 2 :]], i),
                    c,
                ),
            )
        put(f"truncated from record {seq}", lambda r, c, i=i: (r[:i], c))
        put(
            f"truncated from record {seq} with its checkpoints",
            lambda r, c, i=i: (r[:i], [x for x in c if x[0] <= i]),
        )
        if i:
            put(
                f"prefix 1..{seq - 1} cut with its checkpoints",
                lambda r, c, i=i: (r[i:], [x for x in c if x[0] >= i]),
            )
    put(
        "record appended, linked to the head",
        lambda r, c: ([*r, (r[-1][0] + 1, *_relink([*r, _edit_payload(r[-1], 777)], n)[n][1:])], c),
    )
    for j in range(len(cps)):
        cseq = cps[j][0]
        for col, value in (
            (1, "c" * 64),
            (2, "2020-01-01T00:00:00.000000Z"),
            (3, "none"),
            (4, "other"),
            (5, "0" * 64),
            (6, "d" * 64),
            (7, 1000),
        ):
            put(
                f"checkpoint {cseq}: column {col} edited",
                lambda r, c, j=j, col=col, value=value: (
                    r,
                    [*c[:j], (*c[j][:col], value, *c[j][col + 1 :]), *c[j + 1 :]],
                ),
            )
        put(f"checkpoint {cseq}: deleted", lambda r, c, j=j: (r, [*c[:j], *c[j + 1 :]]))
        put(f"checkpoints from {cseq} deleted", lambda r, c, j=j: (r, c[:j]))
        if j + 1 < len(cps):
            put(
                f"checkpoints {cseq} and {cps[j + 1][0]} swapped",
                lambda r, c, j=j: (
                    r,
                    [*c[:j], (c[j][0], *c[j + 1][1:]), (c[j + 1][0], *c[j][1:]), *c[j + 2 :]],
                ),
            )
        at = cseq - 1  # a seq without a checkpoint
        put(
            f"unsigned checkpoint inserted at {at}",
            lambda r, c, at=at, j=j: (
                r,
                sorted(
                    [
                        *c,
                        (
                            at,
                            r[at - 1][7],
                            "2026-01-01T00:00:00.000000Z",
                            "none",
                            "default",
                            "",
                            Checkpoint(*c[j - 1]).digest() if j else GENESIS,
                            4,
                        ),
                    ]
                ),
            ),
        )

        def foreign(r, c, at=at, j=j):
            prev = Checkpoint(*c[j - 1]) if j else None
            cp = other.make(at, r[at - 1][7], "2026-01-01T00:00:00.000000Z", prev, 4)
            return r, sorted([*c, dataclasses.astuple(cp)])

        put(f"checkpoint signed with another key inserted at {at}", foreign)
    return out


async def test_every_single_mutation_of_records_or_checkpoints_is_detected(chain_store):
    settings, tables = chain_store
    await _fill(settings, 12)
    heads = read_heads(settings.witness_path)
    rows, cps = await tables.read()
    assert [c[0] for c in cps] == [4, 8, 12]
    store = build_store(settings)
    await store.open()
    missed = []
    try:
        assert (await _verify(settings, store, expect=heads, require_covered=True)).ok
        mutations = _mutations(rows, cps)
        assert len(mutations) > 150
        for name, mutate in mutations.items():
            new_rows, new_cps = mutate(list(rows), list(cps))
            assert (new_rows, new_cps) != (rows, cps), name
            await tables.write(new_rows, new_cps)
            report = await _verify(settings, store, expect=heads, require_covered=True)
            if report.ok:
                missed.append(name)
        await tables.write(rows, cps)
        assert (await _verify(settings, store, expect=heads, require_covered=True)).ok
    finally:
        await store.close()
    assert not missed, f"undetected: {missed}"


def test_ed25519_public_key_alone_checks_the_chained_checkpoints(tmp_path):
    import asyncio

    key = base64.b64encode(bytes(range(32))).decode()
    settings = AuditSettings(
        sqlite_path=tmp_path / "a.db",
        checkpoint_every=3,
        signing={"algorithm": "ed25519", "key": key, "key_id": "k1"},
    )
    asyncio.run(_fill(settings, 9))
    public = Signer.from_settings(settings.signing).public_key_b64()

    async def check():
        store = build_store(settings)
        await store.open()
        try:
            verifier = Signer.from_settings(settings.signing.model_copy(update={"key": None}), public)
            assert verifier.can_check and not verifier.can_sign
            return await verify_store(store, verifier, require_covered=True)
        finally:
            await store.close()

    report = asyncio.run(check())
    assert report.ok and report.checkpoints_signed == 3, report.problem
    assert Path(tmp_path / "a.db").is_file()
