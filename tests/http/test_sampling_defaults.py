"""Per-model default sampling parameters: applied when the client sends none, never over what it sent, audited."""

from __future__ import annotations

import sqlite3
import uuid

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.reload import reload_config
from gateway.settings import load_settings
from tests.conftest import LITELLM_MODEL, OMNI_MODEL, TEXT_MODEL, gateway_settings
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


# -- vLLM's own extras (extra_body) and OpenAI's newer fields ------------------------------------------------
EXTRAS = {
    "min_p": 0.05,
    "min_tokens": 3,
    "ignore_eos": True,
    "stop_token_ids": [151645, 151643],
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "priority": 10,
}


def _post(server, model: str, **body) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": "hello"}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=10)


@pytest.mark.parametrize("model", [TEXT_MODEL, LITELLM_MODEL])
def test_vllm_extras_reach_a_vllm_engine_as_sent(server, fresh, model):
    resp = _post(server, model, **EXTRAS, guided_choice=["yes", "no"])
    assert resp.status_code == 200, resp.text
    sent = fresh.vllm.requests[-1]
    assert {k: sent.get(k) for k in EXTRAS} == EXTRAS
    # The older guided_* go as the structured_outputs that replaced them in vLLM.
    assert sent["structured_outputs"] == {"choice": ["yes", "no"]} and "guided_choice" not in sent
    resp = _post(
        server, model, structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True}
    )
    assert resp.status_code == 200, resp.text
    sent = fresh.vllm.requests[-1]
    assert sent["structured_outputs"] == {"json": {"type": "object"}, "disable_any_whitespace": True}


def test_vllm_omni_takes_only_the_extras_that_reach_its_thinker(server, fresh):
    resp = _post(server, OMNI_MODEL, min_tokens=2, ignore_eos=True, stop_token_ids=[7])
    assert resp.status_code == 200, resp.text
    sent = fresh.omni_a.requests[-1]
    assert (sent["min_tokens"], sent["ignore_eos"], sent["stop_token_ids"]) == (2, True, [7])
    for field, value in (("min_p", 0.1), ("guided_regex", "a+"), ("priority", 1)):
        before = len(fresh.omni_a.requests)
        refused = _post(server, OMNI_MODEL, **{field: value})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == field
        assert len(fresh.omni_a.requests) == before  # refused, never sent and silently ignored


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"min_p": 2}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "sure"}, "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"priority": -5}, "priority"),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(server, fresh, body, param):
    resp = _post(server, TEXT_MODEL, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_openai_fields_are_taken_and_the_end_user_and_metadata_audited(server, fresh):
    resp, rid = _chat(
        server,
        metadata={"conversation": "c-42", "surface": "voice"},
        safety_identifier="8f14e45f",
        user="legacy-user-7",
        store=False,
        service_tier="auto",
        prompt_cache_key="c-42",
    )
    assert resp.status_code == 200, resp.text
    record = _record(server, rid)
    assert record["metadata"] == {"conversation": "c-42", "surface": "voice"}
    assert record["end_user"] == {"safety_identifier": "8f14e45f", "user": "legacy-user-7"}
    sent = fresh.omni_a.requests[-1]
    for field in ("metadata", "safety_identifier", "store", "service_tier", "prompt_cache_key"):
        assert field not in sent  # the gateway's to honour, not the engine's


@pytest.mark.parametrize(
    ("body", "param"), [({"web_search_options": {}}, "web_search_options"), ({"store": True}, "store")]
)
def test_a_field_that_cannot_be_honoured_is_refused_saying_so(server, fresh, body, param):
    resp, _ = _chat(server, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_field", param)
