"""A store that stalls: no response is acknowledged on a record held in memory; a full buffer sheds or marks a gap."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from observability.audit.chain import Signer
from observability.audit.verify import verify_store
from tests.conftest import TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until

pytestmark = pytest.mark.timeout(60)


def _chat(server, rid: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        headers={"x-request-id": rid},
        timeout=20,
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )


def _rows(db) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        # The id each request was sent with (the gateway's own request_id is not the client's to choose).
        return conn.execute(
            "SELECT seq, kind, json_extract(data, '$.payload.client_request_id'), data "
            "FROM audit_log ORDER BY seq"
        ).fetchall()
    finally:
        conn.close()


@contextmanager
def _write_lock_held(db: Path) -> Iterator[None]:
    """Another connection holds the database's write lock, so the store's commits wait until the block ends."""
    lock = sqlite3.connect(db, isolation_level=None, timeout=0)
    lock.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


@pytest.mark.parametrize("when_full", ["shed", "mark_gap"])
def test_a_full_buffer_applies_the_configured_choice(bg, upstreams, tmp_path, when_full):
    upstreams.reset()
    db = tmp_path / "audit.db"
    # The store is slow (a lock held) but not yet past the patience (ack_timeout_s / 2) that declares it
    # unavailable: two records fill the buffer, the third finds it full.
    settings = gateway_settings(
        upstreams, audit={"sqlite_path": str(db), "buffer": 2, "ack_timeout_s": 20, "when_full": when_full}
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    audit = server.services.audit
    try:
        assert _chat(server, "warm").status_code == 200
        with ThreadPoolExecutor(2) as pool:
            with _write_lock_held(db):
                first = [pool.submit(_chat, server, rid) for rid in ("b1", "b2")]
                assert wait_until(lambda: audit.depth == 2, timeout=10)
                third = _chat(server, "b3")
            assert [f.result().status_code for f in first] == [200, 200]
        if when_full == "shed":
            assert third.status_code == 503
            assert third.json()["error"]["code"] == "overloaded" and third.headers["retry-after"] == "1"
        else:
            assert third.status_code == 200
        assert wait_until(lambda: any(r[1] == "gap" for r in _rows(db)), timeout=20)
        assert _chat(server, "b4").status_code == 200
        rows = _rows(db)
        assert [(r[1], r[2]) for r in rows[:3]] == [
            ("request", "warm"),
            ("request", "b1"),
            ("request", "b2"),
        ] or [(r[1], r[2]) for r in rows[:3]] == [("request", "warm"), ("request", "b2"), ("request", "b1")]
        assert [(r[1], r[2]) for r in rows[3:]] == [("gap", None), ("request", "b4")]
        gap = orjson.loads(rows[3][3])["payload"]
        assert gap["lost"] == 1 and gap["reason"] == ("shed" if when_full == "shed" else "gap")
        report = bg.run(verify_store(audit.store, Signer("none", "default", None)))
        assert report.ok and report.gaps == [(4, 1)]
        metrics = httpx.get(server.url + "/metrics").text
        reason = "shed" if when_full == "shed" else "gap"
        assert f'omnigate_audit_records_dropped_total{{reason="{reason}"}} 1.0' in metrics
        assert "omnigate_audit_buffer_full_total 1.0" in metrics
    finally:
        server.stop()


@pytest.fixture
def impatient(bg, upstreams, tmp_path):
    """A gateway on a SQLite store that gives each record 0.6 s to become durable; it and the store's file."""
    upstreams.reset()
    db = tmp_path / "audit.db"
    settings = gateway_settings(upstreams, audit={"sqlite_path": str(db), "ack_timeout_s": 0.6})
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server, db
    server.stop()


def test_a_store_that_stalls_means_503_not_a_response_on_a_record_held_in_memory(bg, impatient):
    server, db = impatient
    assert _chat(server, "warm").status_code == 200
    with _write_lock_held(db):
        stalled = _chat(server, "s1")  # its record cannot be made durable within ack_timeout_s
        refused = _chat(server, "s2")  # the store is known unavailable: refused before any engine call
    for r in (stalled, refused):
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "audit_unavailable"
        assert "sqlite" not in err["message"].lower() and r.headers["retry-after"] == "1"
    assert wait_until(lambda: _chat(server, "after").status_code == 200, timeout=30)
    rows = _rows(db)
    kinds = [(r[1], r[2]) for r in rows]
    # s1's record reached the store once it was back, followed by the record that its client got a 503.
    assert ("request", "s1") in kinds and ("request_refused", "s1") in kinds
    assert kinds.index(("request", "s1")) < kinds.index(("request_refused", "s1"))
    assert ("request", "s2") in kinds  # refused at admission: its record says so itself
    assert (
        orjson.loads(rows[kinds.index(("request", "s2"))][3])["payload"]["error_code"] == "audit_unavailable"
    )
    assert bg.run(verify_store(server.services.audit.store, Signer("none", "default", None))).ok
    # both: s2's own record (of its refusal) was not durable in time either while the lock was held
    assert "omnigate_audit_ack_timeouts_total 2.0" in httpx.get(server.url + "/metrics").text


def test_a_stream_whose_record_is_not_durable_ends_with_an_error_frame_not_a_clean_done(impatient):
    server, db = impatient
    assert _chat(server, "warm").status_code == 200
    with (
        _write_lock_held(db),
        httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            timeout=20,
            json={"model": TEXT_MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        ) as r,
    ):
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200  # fixed by the first chunk; the stream's end is what acknowledges it
    assert lines[-1] == "data: [DONE]"
    error = orjson.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "audit_unavailable" and set(error) == {"message", "type", "param", "code"}
