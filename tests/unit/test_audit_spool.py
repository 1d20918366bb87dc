"""The spool journal replays in order and once (even after a crash between a replay's commit and its mark);
a store written by the former checkpoint format is migrated in place."""

from __future__ import annotations

import orjson
import pytest

from observability.audit.backends import build_store
from observability.audit.chain import Signer, canonical
from observability.audit.guard import ChainGuard
from observability.audit.log import AuditLog, now_iso
from observability.audit.store import Entry
from observability.audit.verify import verify_store
from observability.metrics import Metrics
from observability.settings import AuditSettings

pytestmark = pytest.mark.timeout(60)

KEY = "spool-checkpoint-secret-71b0c4e2a9"


def _entry(n: int) -> Entry:
    ts = f"2026-01-01T00:00:{n:02d}.000000Z"
    data = canonical(
        {"ts": ts, "kind": "request", "request_id": f"r{n}", "tenant": None, "payload": {"n": n}}
    )
    return Entry(ts, "request", f"r{n}", None, data)


def _line(after: int, e: Entry) -> bytes:
    return (
        orjson.dumps({"t": "rec", "after": after, "e": [e.ts, e.kind, e.request_id, e.tenant, e.data]})
        + b"\n"
    )


async def _rows(settings: AuditSettings):
    store = build_store(settings)
    await store.open()
    try:
        rows = await store.rows(0, 1000)
        report = await verify_store(store, Signer.from_settings(settings.signing), require_covered=True)
    finally:
        await store.close()
    return rows, report


async def test_replay_after_a_crash_between_commit_and_mark_writes_each_record_once_in_order(tmp_path):
    settings = AuditSettings(
        sqlite_path=tmp_path / "a.db",
        on_unavailable="spool",
        spool_path=tmp_path / "s.jsonl",
        checkpoint_every=2,
        signing={"key": KEY},
    )
    entries = [_entry(n) for n in range(1, 5)]
    # The previous process replayed the first two (committed) and died before writing its "done" line.
    # (as a writer appends: record 1 states the chain's cadence, so the replay finds it under that)
    store = build_store(settings)
    await store.open()
    writer = ChainGuard(Signer.from_settings(settings.signing), settings.checkpoint_every, now_iso)
    await store.append_encoded(lambda: entries[:2], writer.sealer(False, []))
    await store.close()
    settings.spool_path.write_bytes(
        b"".join(_line(0, e) for e in entries) + b'{"t": "rec", "aft'
    )  # torn tail
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        assert await audit.append_event("after_restart", {}) is not None
    finally:
        await audit.aclose()
    rows, report = await _rows(settings)
    assert [r.request_id for r in rows if r.kind == "request"] == ["r1", "r2", "r3", "r4"]
    assert rows[-1].kind == "after_restart"  # queued behind the spooled records
    assert report.ok, report.problem
    assert settings.spool_path.read_bytes() == b""  # emptied once replayed


async def test_an_unreadable_journal_line_becomes_a_gap_record(tmp_path):
    settings = AuditSettings(
        sqlite_path=tmp_path / "a.db",
        on_unavailable="spool",
        spool_path=tmp_path / "s.jsonl",
        signing={"key": KEY},
    )
    e1, e2 = _entry(1), _entry(2)
    settings.spool_path.write_bytes(_line(0, e1) + b"\x00garbage\n" + _line(0, e2))
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    await audit.aclose()
    rows, report = await _rows(settings)
    assert [r.kind for r in rows] == ["request", "request", "gap"] or [r.kind for r in rows] == [
        "gap",
        "request",
        "request",
    ]
    gap = next(r for r in rows if r.kind == "gap")
    assert orjson.loads(gap.data)["payload"]["lost"] == 1
    assert report.ok and report.gaps == [(gap.seq, 1)]


async def test_a_store_written_by_the_former_format_is_migrated_and_keeps_verifying(tmp_path):
    import sqlite3

    from observability.audit.chain import checkpoint_message
    from observability.audit.store import chain_rows

    settings = AuditSettings(sqlite_path=tmp_path / "old.db", checkpoint_every=3, signing={"key": KEY})
    db = sqlite3.connect(settings.sqlite_path, isolation_level=None)
    db.executescript("""
        CREATE TABLE audit_log (seq INTEGER PRIMARY KEY, ts TEXT NOT NULL, kind TEXT NOT NULL, request_id TEXT,
            tenant TEXT, data TEXT NOT NULL, prev_hash TEXT NOT NULL, hash TEXT NOT NULL);
        CREATE TABLE audit_checkpoints (seq INTEGER PRIMARY KEY, hash TEXT NOT NULL, created_at TEXT NOT NULL,
            algorithm TEXT NOT NULL, key_id TEXT NOT NULL, signature TEXT NOT NULL);
    """)
    rows = chain_rows([_entry(n) for n in range(1, 4)], 0, "")
    db.executemany(
        "INSERT INTO audit_log VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(r.seq, r.ts, r.kind, r.request_id, r.tenant, r.data, r.prev_hash, r.hash) for r in rows],
    )
    signer = Signer.from_settings(settings.signing)
    created = "2026-01-01T00:00:10.000000Z"
    db.execute(
        "INSERT INTO audit_checkpoints VALUES (?, ?, ?, ?, ?, ?)",
        (
            3,
            rows[-1].hash,
            created,
            "hmac-sha256",
            "default",
            signer.sign(checkpoint_message(3, rows[-1].hash, created, "default")),
        ),
    )
    db.close()
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    try:
        for i in range(4):
            assert await audit.append_event("after_upgrade", {"i": i}) == 4 + i
    finally:
        await audit.aclose()
    _, report = await _rows(settings)
    assert report.ok, report.problem
    assert (report.head_seq, report.checkpoints_signed) == (7, 3)  # the v1 one at 3, then 6 and 7 (on close)


async def test_a_response_served_without_a_record_leaves_a_gap_that_a_crash_cannot_erase(tmp_path):
    import asyncio
    import shutil
    import sqlite3

    db = tmp_path / "a.db"
    settings = AuditSettings(
        sqlite_path=db, buffer=1, when_full="mark_gap", ack_timeout_s=30, signing={"key": KEY}
    )
    audit = AuditLog(settings, build_store(settings), Metrics())
    await audit.start()
    lock = sqlite3.connect(db, isolation_level=None, timeout=0)
    lock.execute("BEGIN IMMEDIATE")  # the store stalls: the writer holds r1, the buffer is full
    try:
        first = audit.submit("request", request_id="r1", payload={})
        assert audit.submit("request", request_id="r2", payload={}) is None  # r2 is served without a record
        assert await audit.wait(None) is None  # returns once the open gap is durable in the journal
        crashed = tmp_path / "crashed"
        crashed.mkdir()
        for name in ("a.db", "a.db-wal", "a.spool"):  # the disk as a SIGKILL here would leave it
            if (tmp_path / name).exists():
                shutil.copy(tmp_path / name, crashed / name)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert await asyncio.wait_for(audit.wait(first), 30) is not None
    await audit.aclose()
    assert _open_gaps(tmp_path / "a.spool") == {}  # the live process wrote its gap record and closed it

    after = settings.model_copy(update={"sqlite_path": crashed / "a.db"})
    restarted = AuditLog(after, build_store(after), Metrics())
    await restarted.start()
    await restarted.aclose()
    rows, report = await _rows(after)
    gaps = [orjson.loads(r.data)["payload"] for r in rows if r.kind == "gap"]
    assert len(gaps) == 1 and gaps[0]["reason"] == "unrecorded_before_restart" and gaps[0]["at_least"]
    assert report.ok, report.problem
    assert _open_gaps(crashed / "a.spool") == {}


def _open_gaps(path):
    from observability.audit.spool import Spool

    spool = Spool(path)
    spool._load()
    spool.close()
    return spool.open_gaps


async def test_two_processes_cannot_spool_into_one_journal(tmp_path):
    settings = AuditSettings(sqlite_path=tmp_path / "a.db", on_unavailable="spool", signing={"key": KEY})
    first = AuditLog(settings, build_store(settings), Metrics())
    await first.start()
    try:
        second = AuditLog(settings, build_store(settings), Metrics())
        with pytest.raises(RuntimeError, match="spool_path"):
            await second.start()
        await second.store.close()
        second.spool.close()
    finally:
        await first.aclose()
    again = AuditLog(settings, build_store(settings), Metrics())  # the lock went with the first
    await again.start()
    await again.aclose()


async def test_a_start_refused_the_journal_closes_what_it_opened(tmp_path):
    """Two processes on one journal: the second is refused at start, and leaves no store, thread or lock
    open behind it (the gateway's boot then fails with nothing to clean up for this writer)."""
    import threading

    settings = AuditSettings(
        sqlite_path=tmp_path / "a.db", on_unavailable="spool", spool_path=tmp_path / "s.jsonl"
    )
    first = AuditLog(settings, build_store(settings), Metrics())
    await first.start()
    try:
        before = set(threading.enumerate())
        second = AuditLog(settings, build_store(settings), Metrics())
        with pytest.raises(RuntimeError, match="another gateway process uses the audit journal"):
            await second.start()
        assert set(threading.enumerate()) <= before  # the store's and the journal's threads are gone
        assert second.spool._lock_fd is None
        await second.aclose()  # harmless after a refused start
    finally:
        await first.aclose()
