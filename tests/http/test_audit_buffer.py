"""A store that stalls: responses wait at most ack_timeout_s, a full buffer sheds or marks a gap, loudly."""

from __future__ import annotations

import sqlite3

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
    return httpx.post(server.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=20,
                      json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]})


def _rows(db) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        # The id each request was sent with (the gateway's own request_id is not the client's to choose).
        return conn.execute("SELECT seq, kind, json_extract(data, '$.payload.client_request_id'), data "
                            "FROM audit_log ORDER BY seq").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("when_full", ["shed", "mark_gap"])
def test_a_full_buffer_applies_the_configured_choice(bg, upstreams, tmp_path, when_full):
    upstreams.reset()
    db = tmp_path / "audit.db"
    settings = gateway_settings(upstreams, audit={"sqlite_path": str(db), "buffer": 2, "ack_timeout_s": 0.3,
                                                  "when_full": when_full})
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        assert _chat(server, "warm").status_code == 200
        # Another process holds the database's write lock: the store stalls.
        lock = sqlite3.connect(db, isolation_level=None, timeout=0)
        lock.execute("BEGIN IMMEDIATE")
        try:
            assert _chat(server, "b1").status_code == 200  # served after ack_timeout_s, record still buffered
            assert _chat(server, "b2").status_code == 200
            third = _chat(server, "b3")
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        if when_full == "shed":
            assert third.status_code == 503
            assert third.json()["error"]["code"] == "overloaded" and third.headers["retry-after"] == "1"
        else:
            assert third.status_code == 200
        assert wait_until(lambda: any(r[1] == "gap" for r in _rows(db)), timeout=20)
        assert _chat(server, "b4").status_code == 200
        rows = _rows(db)
        assert [(r[1], r[2]) for r in rows] == [("request", "warm"), ("request", "b1"), ("request", "b2"),
                                                ("gap", None), ("request", "b4")]
        gap = orjson.loads(rows[3][3])["payload"]
        assert gap["lost"] == 1 and gap["reason"] == ("shed" if when_full == "shed" else "gap")
        report = bg.run(verify_store(server.services.audit.store, Signer("none", "default", None)))
        assert report.ok and report.gaps == [(4, 1)]
        metrics = httpx.get(server.url + "/metrics").text
        reason = "shed" if when_full == "shed" else "gap"
        assert f'omnigate_audit_records_dropped_total{{reason="{reason}"}} 1.0' in metrics
        assert "omnigate_audit_buffer_full_total 1.0" in metrics
        assert "omnigate_audit_ack_timeouts_total 2.0" in metrics
    finally:
        server.stop()
