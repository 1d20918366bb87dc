"""An admin read of the audit trail never holds up the records of the requests being served.

A search or export over a large chain reads for a long time; if it runs where the
writer runs (one SQLite connection on one thread), every commit waits behind it and
tenants get ``503 audit_unavailable``. Here the read is held mid-statement, for as
long as the test wants, by SQLite's own progress handler (so nothing depends on how
fast this machine reads), and requests keep being served and recorded meanwhile: the
read ends only after their commits.
"""

from __future__ import annotations

import sqlite3
import threading

import httpx
import pytest

from tests.console_setup import ADMIN, SIGNING_KEY, chat, config, start, tenant_keys

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
