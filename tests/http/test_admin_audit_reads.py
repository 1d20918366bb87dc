"""An admin read of the audit trail never holds up the records of the requests being served.

A search or export over a large chain reads for a long time; if it runs where the
writer runs (one SQLite connection on one thread), every commit waits behind it and
tenants get ``503 audit_unavailable``. Here the read is held mid-statement, for as
long as the test wants, by SQLite's own progress handler (so nothing depends on how
fast this machine reads), and requests keep being served and recorded meanwhile: the
read ends only after their commits. The PostgreSQL store's reads are held open on the
server, more of them at once than its readers' pool has connections.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import httpx
import pytest

from tests.console_setup import ADMIN, SIGNING_KEY, chat, config, start, tenant_keys
from tests.harness import wait_until

pytestmark = pytest.mark.timeout(120)


class ReadGate:
    """Holds any statement that filters on the record's JSON (what a search by outcome runs) in place."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()
        self._statement = threading.local()
        self._connect = sqlite3.connect

    def connect(self, *args, **kwargs):
        db = self._connect(*args, **kwargs)
        db.set_trace_callback(self._traced)
        db.set_progress_handler(self._progress, 1)
        return db

    def _traced(self, sql: str) -> None:
        self._statement.sql = sql

    def _progress(self) -> int:
        sql = getattr(self._statement, "sql", "")
        if self.armed.is_set() and "json_extract" in sql and "audit_log" in sql:
            self.entered.set()
            self.release.wait(60)  # bounded: a test that forgets to release fails, it does not hang
        return 0


@pytest.fixture
def gated(bg, eng, tmp_path, monkeypatch):
    gate = ReadGate()
    monkeypatch.setattr(sqlite3, "connect", gate.connect)
    keys = tenant_keys()
    audit = {"sqlite_path": str(tmp_path / "audit.db"), "signing": {"key": SIGNING_KEY}, "ack_timeout_s": 2}
    server = start(bg, config(eng, tmp_path, keys, audit=audit), tmp_path / "omnigate.yaml")
    try:
        yield server, keys, gate
    finally:
        gate.release.set()
        server.stop()


@pytest.mark.parametrize("path", ["/admin/audit/records", "/admin/audit/export"])
def test_requests_are_recorded_while_an_admin_read_is_in_progress(gated, path):
    server, keys, gate = gated
    for _ in range(3):
        assert chat(server, keys["acme"].key).status_code == 200

    done: dict[str, httpx.Response] = {}

    def read() -> None:
        done["r"] = httpx.get(server.url + path, params={"outcome": "served"}, headers=ADMIN, timeout=90)

    gate.armed.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert gate.entered.wait(30), "the admin read never reached the store"

    for _ in range(5):
        r = chat(server, keys["acme"].key)
        assert r.status_code == 200, r.text  # its record was committed while the read was held
    assert reader.is_alive() and "r" not in done  # ... and the read is still in the middle of its statement

    gate.release.set()
    reader.join(60)
    assert done["r"].status_code == 200, done["r"].text
    if path.endswith("export"):
        lines = done["r"].text.splitlines()
        assert len(lines) >= 3  # each line one served request's record
    else:
        assert len(done["r"].json()["records"]) >= 3


# -- PostgreSQL ---------------------------------------------------------------------------------------------
# The PostgreSQL store reads (search, export, the chain walks) from a pool of its own, beside the
# writer's. Here every admin read that filters on the outcome is held open on the server, in a
# transaction that has run its statement (its snapshot and its lock on audit_log held), for as long
# as the test wants. Four reads at once are more than the readers' pool holds: two are held on the
# server and two wait for a reader; had they taken the writer's connections, no commit could be made.
_OUTCOME_FILTER = "{payload,outcome}"


class PgReadGate:
    """Holds each read that filters on the outcome in an open transaction on the server."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0  # reads that came to the store
        self.held = 0  # reads held open on the server

    def wrap(self, pool):
        gate = self

        class Gated:
            def __getattr__(self, name):
                return getattr(pool, name)

            async def fetch(self, sql, *args):
                if not (gate.armed.is_set() and _OUTCOME_FILTER in sql):
                    return await pool.fetch(sql, *args)
                with gate._lock:
                    gate.entered += 1
                async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
                    rows = await conn.fetch(sql, *args)
                    with gate._lock:
                        gate.held += 1
                    try:
                        # Waited for off the loop: the gateway serves on while the read is held.
                        await asyncio.get_running_loop().run_in_executor(None, gate.release.wait, 60)
                    finally:
                        with gate._lock:
                            gate.held -= 1
                    return rows

        return Gated()


@pytest.fixture
def pg_gated(bg, eng, tmp_path, monkeypatch):
    from observability.audit.postgres import PostgresStore
    from tests.stores import fresh_pg_database

    gate = PgReadGate()
    real = PostgresStore.reads
    monkeypatch.setattr(PostgresStore, "reads", property(lambda store: gate.wrap(real.fget(store))))
    keys = tenant_keys()
    with fresh_pg_database() as dsn:
        audit = {
            "store": "postgres",
            "postgres_dsn": dsn,
            "signing": {"key": SIGNING_KEY},
            "ack_timeout_s": 2,
        }
        server = start(bg, config(eng, tmp_path, keys, audit=audit), tmp_path / "omnigate.yaml")
        try:
            yield server, keys, gate, dsn
        finally:
            gate.release.set()
            server.stop()


def _held_on_the_server(bg, dsn: str) -> int:
    """How many connections to the test's database sit in a transaction after running an outcome filter."""
    import asyncpg

    async def count() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'idle in transaction' AND position($1 in query) > 0",
                _OUTCOME_FILTER,
            )
        finally:
            await conn.close()

    return bg.run(count())


def test_postgres_requests_are_recorded_while_admin_reads_hold_every_reader(bg, pg_gated):
    server, keys, gate, dsn = pg_gated
    for _ in range(3):
        assert chat(server, keys["acme"].key).status_code == 200

    done: dict[int, httpx.Response] = {}

    def read(i: int, path: str) -> None:
        done[i] = httpx.get(server.url + path, params={"outcome": "served"}, headers=ADMIN, timeout=90)

    paths = ["/admin/audit/records", "/admin/audit/export"] * 2
    gate.armed.set()
    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(paths)]
    for t in readers:
        t.start()
    # Every read came to the store, and only the readers' pool's two are held: the other two wait for a
    # reader, not for one of the writer's connections (four held would be the writer's whole pool).
    assert wait_until(lambda: gate.entered == 4 and gate.held >= 2, timeout=30), (gate.entered, gate.held)
    assert gate.held == 2, f"{gate.held} reads held: they took connections beyond the readers' pool"
    assert _held_on_the_server(bg, dsn) == 2  # open on the server, each with its snapshot and lock

    for _ in range(5):
        r = chat(server, keys["acme"].key)
        assert r.status_code == 200, r.text  # its record was committed while the reads were held
    assert all(t.is_alive() for t in readers) and not done  # ... and the reads are still held

    gate.release.set()
    for t in readers:
        t.join(60)
    for i, path in enumerate(paths):
        assert done[i].status_code == 200, done[i].text
        if path.endswith("export"):
            assert len(done[i].text.splitlines()) >= 3
        else:
            assert len(done[i].json()["records"]) >= 3
    # What the held reads could not see is there for the next one.
    after = httpx.get(server.url + "/admin/audit/records", params={"outcome": "served"}, headers=ADMIN)
    assert len(after.json()["records"]) >= 8
