"""API keys, tenants, per-tenant policy sets and rate limits, and the audit record of every outcome."""

from __future__ import annotations

import hashlib
import sqlite3

import httpx
import orjson
import pytest
import structlog
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.plugins import PLUGINS
from tests.stores import redis_prefix
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

TENANTS = ("acme", "globex", "strict", "limited", "tokens", "dormant", "revoked")


@pytest.fixture(scope="module")
def keys():
    return {name: mint_key() for name in TENANTS}


@pytest.fixture(scope="module")
def server(bg, upstreams, keys, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams,
        policy_sets={
            "tagged": PolicyChainConfig(pre=[PolicySpec(name="append-tag", config={"tag": "t"})]),
            "strict": PolicyChainConfig(
                pre=[PolicySpec(name="always-reject"), PolicySpec(name="append-tag", config={"tag": "never"})]
            ),
        },
        tenants=[
            {
                "name": "acme",
                "models": [TEXT_MODEL],
                "priority": "interactive",
                "max_concurrency": 4,
                "audit_content": "redacted",
            },
            {"name": "globex", "policy_set": "tagged", "priority": "batch"},
            {"name": "strict", "policy_set": "strict"},
            {"name": "limited", "requests_per_minute": 2},
            {"name": "tokens", "tokens_per_minute": 20},
            {"name": "dormant", "enabled": False},
            {"name": "revoked"},
        ],
        api_keys=[
            {"id": k.id, "tenant": name, "sha256": k.sha256, "enabled": name != "revoked"}
            for name, k in keys.items()
        ],
        rate_limits={"key_prefix": redis_prefix()},
        redis={"url": "redis://127.0.0.1:6379/0"},  # the limits as replicas share them
        traffic={"key_prefix": f"{redis_prefix()}:traffic"},
        audit={"sqlite_path": str(db)},
    )
    s = GatewayServer(bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}).start()
    s.db = db
    yield s
    s.stop()


@pytest.fixture
def fresh(server, upstreams):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    return upstreams


def _chat(
    server, key: str | None, model: str = TEXT_MODEL, text: str = "hello", rid: str | None = None, **body
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if rid:
        headers["x-request-id"] = rid
    payload = {"model": model, "messages": [{"role": "user", "content": text}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, headers=headers, timeout=10)


def _record(server, rid: str) -> dict | None:
    """Read the store directly, through its own connection (what an auditor would see)."""
    db = sqlite3.connect(server.db)
    try:
        # The gateway makes request ids; the id a client sent is kept as client_request_id.
        row = db.execute(
            "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?", (rid,)
        ).fetchone()
    finally:
        db.close()
    return None if row is None else orjson.loads(row[0])


def test_missing_bad_and_disabled_keys_are_401_and_indistinguishable(server, fresh, keys):
    bodies = []
    forged = keys["acme"].key[:-4] + "abcd"
    for key in (
        None,
        "nonsense",
        "og_aaaaaaaaaaaa_" + "x" * 43,
        forged,
        keys["dormant"].key,
        keys["revoked"].key,
    ):
        resp = _chat(server, key)
        assert resp.status_code == 401, (key, resp.text)
        bodies.append(resp.json())
    # No key at all is told so in OpenAI's words; every key that is wrong, unknown or disabled gets one body.
    assert bodies[0]["error"]["message"].startswith("You didn't provide an API key")
    assert all(b == bodies[1] for b in bodies[1:])
    err = bodies[1]["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    assert fresh.vllm.request_count == 0
    metrics = httpx.get(server.url + "/metrics").text
    for reason, n in (("missing", 1), ("invalid", 3), ("disabled", 2)):
        assert f'omnigate_auth_failures_total{{reason="{reason}"}} {n}.0' in metrics
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_a_key_scopes_models_and_sets_priority_and_quota(server, fresh, keys):
    acme = keys["acme"].key
    listed = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {acme}"}).json()
    assert [m["id"] for m in listed["data"]] == [TEXT_MODEL]
    denied = _chat(server, acme, model=OMNI_MODEL)
    assert denied.status_code == 404 and denied.json()["error"]["code"] == "model_not_found"
    assert _chat(server, acme, rid="scoped-ok").status_code == 200
    rec = _record(server, "scoped-ok")
    assert rec["tenant"] == "acme"
    p = rec["payload"]
    assert (p["key_id"], p["priority"], p["max_concurrency"]) == (keys["acme"].id, "interactive", 4)


def test_each_tenant_gets_its_policy_set(server, fresh, keys):
    assert _chat(server, keys["globex"].key).status_code == 200
    assert fresh.vllm.requests[-1]["messages"][-1]["content"] == "hello[t]"
    assert _chat(server, keys["acme"].key).status_code == 200
    assert fresh.vllm.requests[-1]["messages"][-1]["content"] == "hello"


def test_requests_per_minute_is_a_429_with_retry_after(server, fresh, keys):
    key = keys["limited"].key
    assert [_chat(server, key).status_code for _ in range(2)] == [200, 200]
    resp = _chat(server, key)
    assert resp.status_code == 429
    assert 1 <= int(resp.headers["retry-after"]) <= 60
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
    assert "requests per minute" in err["message"]
    assert fresh.vllm.request_count == 2
    # Another tenant is not affected.
    assert _chat(server, keys["globex"].key).status_code == 200


def test_tokens_per_minute_are_charged_after_the_response(server, fresh, keys):
    key = keys["tokens"].key
    fresh.vllm.default = Script(flavour="vllm", text="one two three four five six seven eight nine ten")
    assert _chat(server, key).status_code == 200  # 11 prompt + 10 completion tokens: over the budget of 20
    assert wait_until(lambda: _chat(server, key).status_code == 429, timeout=10)
    resp = _chat(server, key)
    assert resp.status_code == 429 and "tokens per minute" in resp.json()["error"]["message"]
    assert int(resp.headers["retry-after"]) >= 1


def test_a_policy_that_did_not_run_is_not_in_the_record(server, fresh, keys):
    resp = _chat(server, keys["strict"].key, rid="strict-1")
    assert resp.status_code == 400
    p = _record(server, "strict-1")["payload"]
    assert [(x["name"], x["stage"], x["verdict"]) for x in p["policies"]] == [
        ("always-reject", "pre", "reject")
    ]
    assert p["outcome"] == "refused" and p["error_code"] == "content_policy_violation"


def test_streamed_record_is_durable_before_done(server, fresh, keys):
    fresh.vllm.default = Script(flavour="vllm", text="Streamed words for the record.")
    text = []
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=10,
        headers={"authorization": f"Bearer {keys['globex'].key}", "x-request-id": "stream-1"},
        json={"model": TEXT_MODEL, "stream": True, "messages": [{"role": "user", "content": "say it"}]},
    ) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                # The record must already be in the store when [DONE] arrives.
                rec = _record(server, "stream-1")
                break
            if line.startswith("data: "):
                chunk = orjson.loads(line[6:])
                for c in chunk["choices"]:
                    text.append(c["delta"].get("content") or "")
    assert rec is not None
    p = rec["payload"]
    assert (p["outcome"], p["status"], p["stream"], p["engine"], p["variant"]) == (
        "served",
        200,
        True,
        "text-vllm",
        "fp16",
    )
    assert p["input"] == [
        {"role": "user", "type": "text", "chars": 6, "sha256": hashlib.sha256(b"say it").hexdigest()}
    ]
    assert p["output"]["text_sha256"] == hashlib.sha256("".join(text).encode()).hexdigest()
    assert [(x["name"], x["verdict"]) for x in p["policies"]] == [("append-tag", "rewrite")]
    assert p["policies"][0]["duration_ms"] >= 0
    assert "content" not in p  # globex keeps digests only


def test_every_outcome_has_a_record(server, fresh, keys):
    acme = keys["acme"].key
    assert _chat(server, None, rid="o-401").status_code == 401
    assert _chat(server, acme, rid="o-404", model="nope").status_code == 404
    assert _chat(server, acme, rid="o-degraded", max_tokens=100_000).status_code == 200
    fresh.vllm.default = Script(flavour="vllm", fault="500_before_headers")
    assert _chat(server, acme, rid="o-failed").status_code >= 500
    fresh.vllm.default = Script(flavour="vllm", text="a b c d e f g h", chunk_delay_s=0.3)
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=10,
        headers={"authorization": f"Bearer {acme}", "x-request-id": "o-cancelled"},
        json={"model": TEXT_MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        next(r.iter_lines())  # the response has started; leave
    assert wait_until(lambda: _record(server, "o-cancelled") is not None, timeout=10)
    outcomes = {
        rid: _record(server, rid)["payload"] for rid in ("o-404", "o-degraded", "o-failed", "o-cancelled")
    }
    # A refused key has no record of its own: it is counted in the interval's auth_failures record.
    assert _record(server, "o-401") is None
    assert outcomes["o-404"]["outcome"] == "refused" and outcomes["o-404"]["error_code"] == "model_not_found"
    assert outcomes["o-degraded"]["outcome"] == "degraded"
    assert outcomes["o-degraded"]["degraded"] == ["max-tokens-capped"]
    assert outcomes["o-failed"]["outcome"] == "failed"
    assert outcomes["o-cancelled"]["outcome"] == "cancelled"


def test_redacted_content_for_tenants_that_keep_it(server, fresh, keys):
    fresh.vllm.default = Script(flavour="vllm", text="Write to ops@example.com today.")
    resp = _chat(
        server, keys["acme"].key, text="I am jane@corp.example, card 4111 1111 1111 1111", rid="pii-1"
    )
    assert resp.status_code == 200
    content = _record(server, "pii-1")["payload"]["content"]
    assert content["mode"] == "redacted"
    assert content["messages"] == [{"role": "user", "text": "I am [EMAIL], card [CARD]"}]
    assert content["output_text"] == "Write to [EMAIL] today."


def test_keys_never_reach_the_logs(server, fresh, keys):
    with structlog.testing.capture_logs() as events:
        for name in ("acme", "dormant", "revoked"):
            _chat(server, keys[name].key)
        _chat(server, keys["acme"].key[:-2] + "zz")
    assert events, "the requests were logged"
    dumped = orjson.dumps(events, default=str).decode()
    for k in keys.values():
        assert k.key not in dumped and k.key.split("_", 2)[2] not in dumped
