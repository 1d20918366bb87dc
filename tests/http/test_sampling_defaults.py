"""Per-model default sampling parameters: applied when the client sends none, never over what it sent, audited."""

from __future__ import annotations

import sqlite3
import uuid

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry

from core.settings import load_settings
from gateway.reload import reload_config
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until

pytestmark = pytest.mark.timeout(60)

DEFAULTS = {"temperature": 0.7, "top_p": 0.9}


@pytest.fixture(scope="module")
def server(bg, upstreams, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams, audit={"sqlite_path": str(db)}, models={OMNI_MODEL: {"sampling_defaults": DEFAULTS}}
    )
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    s.db = db
    yield s
    s.stop()


@pytest.fixture
def fresh(upstreams, server):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    return upstreams


def _chat(server, **body) -> tuple[httpx.Response, str]:
    rid = uuid.uuid4().hex
    payload = {"model": OMNI_MODEL, "messages": [{"role": "user", "content": "hello"}], **body}
    resp = httpx.post(
        server.url + "/v1/chat/completions", json=payload, headers={"x-request-id": rid}, timeout=10
    )
    return resp, rid


def _record(server, rid: str) -> dict:
    def row():
        db = sqlite3.connect(server.db)
        try:
            return db.execute(
                "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?",
                (rid,),
            ).fetchone()
        finally:
            db.close()

    assert wait_until(lambda: row() is not None, timeout=10)
    return orjson.loads(row()[0])["payload"]


def test_defaults_reach_the_engine_when_the_client_sends_none(server, fresh):
    resp, rid = _chat(server)
    assert resp.status_code == 200, resp.text
    sent = fresh.omni_a.requests[-1]
    assert sent["temperature"] == 0.7
    assert sent["top_p"] == 0.9
    assert _record(server, rid)["sampling_defaults"] == DEFAULTS


def test_what_the_client_sent_is_never_overridden(server, fresh):
    resp, rid = _chat(server, temperature=0.0)
    assert resp.status_code == 200, resp.text
    sent = fresh.omni_a.requests[-1]
    assert sent["temperature"] == 0.0  # greedy, as asked
    assert sent["top_p"] == 0.9  # the one it did not send
    assert _record(server, rid)["sampling_defaults"] == {"top_p": 0.9}

    resp, rid = _chat(server, temperature=1.2, top_p=0.5)
    sent = fresh.omni_a.requests[-1]
    assert (sent["temperature"], sent["top_p"]) == (1.2, 0.5)
    assert "sampling_defaults" not in _record(server, rid)


def test_streamed_requests_get_them_too(server, fresh):
    payload = {"model": OMNI_MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=10) as resp:
        assert resp.status_code == 200
        resp.read()
    sent = fresh.omni_a.requests[-1]
    assert (sent["temperature"], sent["top_p"]) == (0.7, 0.9)


def test_a_model_without_defaults_sends_none(server, fresh):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=10,
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hello"}]},
    )
    assert resp.status_code == 200
    sent = fresh.vllm.requests[-1]
    assert "temperature" not in sent and "top_p" not in sent


def test_a_reload_changes_the_defaults_for_the_next_request(bg, upstreams, tmp_path):
    upstreams.reset()
    doc = {
        "engines": [
            {
                "name": "text-vllm",
                "kind": "vllm",
                "base_url": upstreams.vllm.base_url,
                "model": "scripted",
                "serves": [TEXT_MODEL],
            }
        ],
        "models": {TEXT_MODEL: {"sampling_defaults": {"temperature": 0.7}}},
        "audit": {"sqlite_path": str(tmp_path / "a.db")},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    s = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
    body = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hello"}]}
    try:
        assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        assert upstreams.vllm.requests[-1]["temperature"] == 0.7
        path.write_text(
            yaml.safe_dump({**doc, "models": {TEXT_MODEL: {"sampling_defaults": {"top_p": 0.5}}}})
        )
        result = bg.run(reload_config(s.services, path))
        assert result.ok and "models" not in result.restart_required
        assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        sent = upstreams.vllm.requests[-1]
        assert sent["top_p"] == 0.5 and "temperature" not in sent
    finally:
        s.stop()
