"""The front door in one process over real sockets: authentication that cannot turn itself off, a directory
that fails closed, refused keys that cannot grow the audit chain, gateway-made request ids, the admin
credential on every admin change, /readyz detail for the admin only and /metrics on a port of its own."""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.reload import reload_config
from gateway.settings import load_settings
from gateway.tenants import mint_key
from tests.conftest import LITELLM_MODEL, OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.stores import fresh_pg_database, redis_prefix
from tests.tcpproxy import TCPProxy

pytestmark = pytest.mark.timeout(90)

ADMIN_KEY = secrets.token_hex(32)
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _chat(server, key: str | None = None, headers: dict | None = None) -> httpx.Response:
    h = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        server.url + "/v1/chat/completions",
        headers={**h, **(headers or {})},
        timeout=10,
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )


def _admin(server, method: str, path: str, key: str = ADMIN_KEY, **kw) -> httpx.Response:
    return httpx.request(
        method, server.url + "/admin" + path, headers={"authorization": f"Bearer {key}"}, timeout=10, **kw
    )


def _rows(db) -> list[tuple[str, str | None, dict]]:
    conn = sqlite3.connect(db)
    try:
        return [
            (k, rid, orjson.loads(d))
            for k, rid, d in conn.execute("SELECT kind, request_id, data FROM audit_log ORDER BY seq")
        ]
    finally:
        conn.close()


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


@pytest.fixture
def started(bg, upstreams, tmp_path):
    servers: list[GatewayServer] = []

    def start(**extra) -> GatewayServer:
        upstreams.reset()
        extra.setdefault("audit", {"sqlite_path": str(tmp_path / f"audit-{len(servers)}.db")})
        extra.setdefault("rate_limits", {"key_prefix": redis_prefix()})
        s = GatewayServer(bg, gateway_settings(upstreams, **extra), CollectorRegistry()).start()
        s.db = extra["audit"].get("sqlite_path")
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


# -- authentication never turns itself off ----------------------------------------------------------
def test_an_admin_key_and_no_tenant_means_every_request_is_refused_and_readyz_says_why(started):
    server = started(admin={"api_key": ADMIN_KEY})
    assert _chat(server).status_code == 401
    assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
    ready = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5).json()
    assert ready["auth"]["required"] is True and ready["auth"]["tenants"] == 0
    assert "every request gets 401" in ready["auth"]["reason"]


def test_a_tenant_created_on_a_fresh_store_does_not_switch_authentication_on_only_then(started):
    server = started(admin={"api_key": ADMIN_KEY})
    assert _chat(server).status_code == 401  # before: the first tenant turned authentication on
    assert _admin(server, "POST", "/tenants", json={"name": "newco"}).status_code == 201
    key = _admin(server, "POST", "/keys", json={"tenant": "newco"}).json()["key"]
    assert _chat(server, key).status_code == 200
    assert _chat(server).status_code == 401


def test_removing_the_last_tenant_by_reload_does_not_open_the_gateway(bg, upstreams, tmp_path):
    upstreams.reset()
    k = mint_key()
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
        "tenants": [{"name": "only"}],
        "api_keys": [{"id": k.id, "tenant": "only", "sha256": k.sha256}],
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": {"sqlite_path": str(tmp_path / "a.db")},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    server = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
    try:
        assert _chat(server, k.key).status_code == 200 and _chat(server).status_code == 401
        path.write_text(yaml.safe_dump({**doc, "tenants": [], "api_keys": []}))
        result = bg.run(reload_config(server.services, path))
        assert result.ok and "auth" in result.restart_required
        assert _chat(server).status_code == 401
        assert _chat(server, k.key).status_code == 401  # its tenant is gone
    finally:
        server.stop()


def test_required_false_next_to_tenants_or_a_shared_directory_is_refused():
    from pydantic import ValidationError

    from gateway.settings import Settings

    with pytest.raises(
        ValidationError, match=re.escape("auth.required is false, but the config names tenants")
    ):
        Settings(auth={"required": False}, tenants=[{"name": "a"}])
    with pytest.raises(ValidationError, match="a shared directory"):
        Settings(
            auth={"required": False, "directory": {"backend": "postgres", "postgres_dsn": "postgresql://x/y"}}
        )


def test_admin_writes_to_a_per_process_directory_are_refused_with_several_replicas(started):
    server = started(admin={"api_key": ADMIN_KEY}, auth={"replicas": 3})
    refused = _admin(server, "POST", "/tenants", json={"name": "newco"})
    assert refused.status_code == 409
    err = refused.json()["error"]
    assert (
        err["code"] == "conflict" and "auth.replicas is 3" in err["message"] and "postgres" in err["message"]
    )
    assert _admin(server, "GET", "/tenants").status_code == 200
    ready = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5).json()
    assert ready["auth"]["directory"]["admin_writes"].startswith("auth.replicas is 3")


def test_admin_writes_are_refused_when_authentication_is_off(started):
    server = started(admin={"api_key": ADMIN_KEY}, auth={"required": False})
    assert _chat(server).status_code == 200
    refused = _admin(server, "POST", "/tenants", json={"name": "newco"})
    assert refused.status_code == 409 and "auth.required: false" in refused.json()["error"]["message"]


def test_a_missing_key_and_a_wrong_key_get_openais_words_and_every_401_names_the_bearer_scheme(started):
    k = mint_key()
    server = started(
        admin={"api_key": ADMIN_KEY},
        tenants=[{"name": "t"}],
        api_keys=[{"id": k.id, "tenant": "t", "sha256": k.sha256}],
    )
    missing = [_chat(server), _chat(server, headers={"authorization": "Basic dXNlcjpwYXNz"})]
    for r in missing:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"].startswith(
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)"
        )
        assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("invalid_request_error", None)
    for wrong in ("nonsense", "og_aaaaaaaaaaaa_" + "x" * 43, k.key[:-4] + "abcd"):
        r = _chat(server, wrong)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["message"].startswith("Incorrect API key provided") and err["code"] == "invalid_api_key"
    models = httpx.get(server.url + "/v1/models", timeout=5)
    assert models.status_code == 401 and models.headers["www-authenticate"] == "Bearer"
    admin = _admin(server, "GET", "/tenants", key="wrong-" + ADMIN_KEY)
    assert admin.status_code == 401 and admin.headers["www-authenticate"] == "Bearer"
    assert _chat(server, k.key).status_code == 200


def test_models_retrieve_answers_openais_model_object_and_a_404_in_openais_shape(started):
    import openai

    k = mint_key()
    server = started(
        tenants=[{"name": "all"}, {"name": "text-only", "models": [TEXT_MODEL]}],
        api_keys=[
            {"id": k.id, "tenant": "text-only", "sha256": k.sha256},
        ],
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=k.key, max_retries=0)
    model = client.models.retrieve(TEXT_MODEL)
    assert (model.id, model.object, model.owned_by) == (TEXT_MODEL, "model", "omnigate") and model.created > 0
    assert [m.id for m in client.models.list()] == [TEXT_MODEL]
    for hidden in (OMNI_MODEL, "no-such-model", "org/with-a-slash"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(hidden)
        err = caught.value.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error",
            "model_not_found",
            "model",
        )
        assert hidden in err["message"]
    anonymous = httpx.get(server.url + "/v1/models/" + TEXT_MODEL, timeout=5)
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"


def test_models_retrieve_without_authentication_serves_every_model(started):
    server = started()
    body = httpx.get(server.url + "/v1/models/" + OMNI_MODEL, timeout=5).json()
    assert body == {"id": OMNI_MODEL, "object": "model", "created": body["created"], "owned_by": "omnigate"}
    assert httpx.get(server.url + "/v1/models/nothing", timeout=5).status_code == 404


# -- the directory fails closed -----------------------------------------------------------------------
def test_directory_keys_are_refused_once_the_directory_is_unread_too_long_and_config_keys_keep_working(
    bg, started
):
    config_key = mint_key()
    with fresh_pg_database() as dsn:
        proxy = bg.run(TCPProxy("127.0.0.1", 5432).start())
        try:
            db = dsn.rsplit("/", 1)[1]
            server = started(
                admin={"api_key": ADMIN_KEY},
                tenants=[{"name": "cfg"}],
                api_keys=[{"id": config_key.id, "tenant": "cfg", "sha256": config_key.sha256}],
                auth={
                    "directory": {
                        "backend": "postgres",
                        "postgres_dsn": f"postgresql://postgres@127.0.0.1:{proxy.port}/{db}",
                        "refresh_s": 0.2,
                        "timeout_s": 0.5,
                        "fail_closed_after_s": 1.5,
                    }
                },
            )
            assert _admin(server, "POST", "/tenants", json={"name": "dir"}).status_code == 201
            key = _admin(server, "POST", "/keys", json={"tenant": "dir"}).json()["key"]
            assert _chat(server, key).status_code == 200
            assert _metric(server, "omnigate_directory_fresh") == 1

            proxy.mode = "blackhole"  # reads now hang: a partitioned database
            bg.run(proxy.stop())
            bg.run(proxy.start("blackhole"))
            assert wait_until(lambda: _chat(server, key).status_code == 503, timeout=20, interval=0.1)
            refused = _chat(server, key)
            assert (
                refused.json()["error"]["code"] == "directory_unavailable" and refused.headers["retry-after"]
            )
            assert _chat(server, config_key.key).status_code == 200
            assert (
                _chat(server, key[:-3] + "abc").status_code == 401
            )  # a wrong secret still learns nothing more
            assert _metric(server, "omnigate_directory_fresh") == 0
            assert _metric(server, "omnigate_directory_read_errors_total") >= 1

            bg.run(proxy.stop())
            bg.run(proxy.start("up"))
            assert wait_until(lambda: _chat(server, key).status_code == 200, timeout=20, interval=0.1)
            assert _metric(server, "omnigate_directory_fresh") == 1
        finally:
            bg.run(proxy.stop())


# -- refused requests: no record each, an aggregate, a limit per address --------------------------------
def test_refused_keys_do_not_grow_the_chain_one_each_and_are_summarised(started):
    k = mint_key()
    server = started(
        tenants=[{"name": "t"}],
        api_keys=[{"id": k.id, "tenant": "t", "sha256": k.sha256}],
        auth={"failures": {"max_failures": 10_000}},
    )
    before = len(_rows(server.db))
    for i in range(40):
        assert _chat(server, None if i % 2 else "og_aaaaaaaaaaaa_" + "x" * 43).status_code == 401
    assert _chat(server, k.key).status_code == 200
    summary = server.bg.run(server.services.summarise_failures())
    assert summary["refused"] == 40 and summary["by_reason"] == {"invalid": 20, "missing": 20}
    assert summary["top_addresses"] == [{"address": "127.0.0.1", "failures": 40}]
    assert wait_until(lambda: any(r[0] == "auth_failures" for r in _rows(server.db)), timeout=10)
    new = _rows(server.db)[before:]
    assert sorted(k for k, _, _ in new) == ["auth_failures", "request"]  # one aggregate, one served request
    assert next(r for r in new if r[0] == "auth_failures")[2]["payload"]["refused"] == 40
    assert server.bg.run(server.services.summarise_failures()) is None  # nothing since: nothing written


def test_an_address_that_keeps_failing_gets_429_even_for_a_valid_key(started):
    k = mint_key()
    server = started(
        tenants=[{"name": "t"}],
        api_keys=[{"id": k.id, "tenant": "t", "sha256": k.sha256}],
        auth={"failures": {"max_failures": 5, "window_s": 60}},
    )
    assert [_chat(server).status_code for _ in range(5)] == [401] * 5
    throttled = _chat(server, "nonsense")
    assert throttled.status_code == 429
    err = throttled.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (
        err["code"] == "too_many_authentication_failures" and 1 <= int(throttled.headers["retry-after"]) <= 60
    )
    # Blocked, the address is refused before its key is looked at (tests/hardening/test_auth_bruteforce.py).
    assert _chat(server, k.key).status_code == 429
    assert _metric(server, "omnigate_auth_throttled_total") == 2


def test_the_failure_limit_is_shared_through_redis_by_replicas(started):
    k = mint_key()
    common = {
        "tenants": [{"name": "t"}],
        "api_keys": [{"id": k.id, "tenant": "t", "sha256": k.sha256}],
        "auth": {"failures": {"max_failures": 6}},
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "traffic": {"key_prefix": redis_prefix()},
        "rate_limits": {"key_prefix": redis_prefix()},
    }
    a, b = started(**common), started(**common)
    assert [_chat(a).status_code for _ in range(3)] == [401] * 3
    assert [_chat(b).status_code for _ in range(3)] == [401] * 3
    assert _chat(a).status_code == 429 and _chat(b).status_code == 429


# -- request ids are the gateway's ------------------------------------------------------------------
def test_a_client_cannot_choose_the_request_id_of_its_record(started):
    k = mint_key()
    server = started(tenants=[{"name": "t"}], api_keys=[{"id": k.id, "tenant": "t", "sha256": k.sha256}])
    victim = _chat(server, k.key)
    forged = _chat(server, k.key, headers={"x-request-id": victim.headers["x-request-id"]})
    assert forged.status_code == 200 and forged.headers["x-request-id"] != victim.headers["x-request-id"]
    assert forged.headers["x-client-request-id"] == victim.headers["x-request-id"]
    hostile = _chat(server, k.key, headers={"x-client-request-id": "id with spaces;<script>\t" + "z" * 200})
    assert hostile.headers["x-client-request-id"] == ("idwithspacesscript" + "z" * 200)[:64]
    assert wait_until(lambda: len([r for r in _rows(server.db) if r[0] == "request"]) == 3, timeout=10)
    records = {rid: d["payload"] for kind, rid, d in _rows(server.db) if kind == "request"}
    assert set(records) == {r.headers["x-request-id"] for r in (victim, forged, hostile)}
    assert records[forged.headers["x-request-id"]]["client_request_id"] == victim.headers["x-request-id"]
    assert records[victim.headers["x-request-id"]]["client_request_id"] is None


def test_every_engine_request_carries_the_gateways_request_id_so_the_logs_join(started, upstreams):
    """vLLM adopts ``X-Request-Id`` as its own request id: its log lines then name the gateway's request."""
    server = started()
    seen = []
    for model, upstream, stream in (
        (TEXT_MODEL, upstreams.vllm, False),
        (TEXT_MODEL, upstreams.vllm, True),
        (OMNI_MODEL, upstreams.omni_a, True),
        (OMNI_MODEL, upstreams.omni_a, False),
        (LITELLM_MODEL, upstreams.vllm, False),
        (LITELLM_MODEL, upstreams.vllm, True),
    ):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            # the client's own id stays the client's: the engine gets the gateway's
            headers={"x-request-id": "client-chosen"},
            timeout=10,
            json={"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, (model, r.text)
        assert upstream.headers[-1]["x-request-id"] == r.headers["x-request-id"] != "client-chosen"
        seen.append(r.headers["x-request-id"])
    assert len(set(seen)) == len(seen)


def test_a_failover_sends_the_next_engine_a_request_id_of_its_own_that_still_names_the_gateways(
    started, upstreams
):
    """vLLM refuses an id still running; an attempt aborted a moment ago may be: each call gets its own."""
    from tests.upstream import Script

    server = started()
    upstreams.omni_a.enqueue(Script(flavour="omni", fault="500_before_headers"))
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=10,
        json={"model": OMNI_MODEL, "stream": False, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert upstreams.omni_a.headers[-1]["x-request-id"] == rid
    assert upstreams.omni_b.headers[-1]["x-request-id"] == f"{rid}-2"


def test_logging_log_prompts_is_refused_as_a_setting_nothing_reads(tmp_path):
    from pydantic import ValidationError

    from gateway.settings import Settings

    with pytest.raises(ValidationError, match="log_prompts"):
        Settings(logging={"log_prompts": True})


# -- the admin credential, not the body, says who did it -----------------------------------------------------
def test_each_admin_change_records_the_credential_that_made_it(started):
    alice, bob = secrets.token_hex(32), secrets.token_hex(32)
    server = started(
        admin={
            "keys": [
                {"name": "alice", "sha256": hashlib.sha256(alice.encode()).hexdigest()},
                {"name": "bob", "sha256": hashlib.sha256(bob.encode()).hexdigest()},
            ]
        }
    )
    assert _admin(server, "POST", "/tenants", key=alice, json={"name": "newco"}).status_code == 201
    made = _admin(server, "POST", "/keys", key=bob, json={"tenant": "newco"}).json()
    assert _admin(server, "DELETE", f"/keys/{made['id']}", key=alice).status_code == 200
    assert _admin(server, "GET", "/tenants", key="wrong-" + alice).status_code == 401
    assert wait_until(lambda: len([r for r in _rows(server.db) if r[0] == "admin_change"]) == 3, timeout=10)
    changes = [d["payload"] for kind, _, d in _rows(server.db) if kind == "admin_change"]
    assert [(c["action"], c["by"]["credential"]) for c in changes] == [
        ("tenant_created", "alice"),
        ("key_created", "bob"),
        ("key_revoked", "alice"),
    ]
    assert changes[0]["by"]["fingerprint"] == hashlib.sha256(alice.encode()).hexdigest()[:12]
    assert alice not in str(changes) and bob not in str(changes)


def test_wrong_admin_keys_are_counted_and_limited_per_address(started):
    server = started(admin={"api_key": ADMIN_KEY}, auth={"failures": {"max_failures": 3}})
    assert [_admin(server, "GET", "/tenants", key=secrets.token_hex(32)).status_code for _ in range(3)] == [
        401
    ] * 3
    limited = _admin(server, "GET", "/tenants", key=secrets.token_hex(32))
    assert limited.status_code == 429 and limited.headers["retry-after"]
    # The real credential too, while the address is blocked: a guess that is right is not let through.
    assert _admin(server, "GET", "/tenants").status_code == 429
    assert server.bg.run(server.services.summarise_failures())["by_reason"] == {"admin": 4}


def test_a_reload_records_the_credential_that_asked_for_it(bg, upstreams, tmp_path):
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
        "admin": {"api_key": ADMIN_KEY},
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": {"sqlite_path": str(tmp_path / "a.db")},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    server = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
    try:
        assert _admin(server, "POST", "/config/reload").status_code == 200
        assert wait_until(
            lambda: any(k == "config_reload" for k, _, _ in _rows(tmp_path / "a.db")), timeout=10
        )
        [event] = [d["payload"] for k, _, d in _rows(tmp_path / "a.db") if k == "config_reload"]
        assert event["by"] == {
            "credential": "api_key",
            "fingerprint": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12],
        }
    finally:
        server.stop()


def test_a_gateway_started_while_the_directory_is_down_serves_config_keys_and_catches_up(bg, started):
    config_key = mint_key()
    with fresh_pg_database() as dsn:
        proxy = TCPProxy("127.0.0.1", 5432)  # not listening yet: the directory is down at boot
        try:
            server = started(
                admin={"api_key": ADMIN_KEY},
                tenants=[{"name": "cfg"}],
                api_keys=[{"id": config_key.id, "tenant": "cfg", "sha256": config_key.sha256}],
                auth={
                    "directory": {
                        "backend": "postgres",
                        "postgres_dsn": f"postgresql://postgres@127.0.0.1:{proxy.port}/"
                        + dsn.rsplit("/", 1)[1],
                        "refresh_s": 0.2,
                        "timeout_s": 0.5,
                    }
                },
            )
            assert _chat(server, config_key.key).status_code == 200
            assert _metric(server, "omnigate_directory_fresh") == 0
            assert _admin(server, "POST", "/tenants", json={"name": "dir"}).status_code == 503
            bg.run(proxy.start("up"))
            assert wait_until(
                lambda: _metric(server, "omnigate_directory_fresh") == 1, timeout=20, interval=0.1
            )
            assert _admin(server, "POST", "/tenants", json={"name": "dir"}).status_code == 201
        finally:
            bg.run(proxy.stop())


# -- /readyz detail and /metrics -------------------------------------------------------------------------------
def test_readyz_detail_is_for_the_admin_credential_only(started):
    server = started(admin={"api_key": ADMIN_KEY})
    for headers in ({}, {"authorization": "Bearer " + mint_key().key}, {"authorization": "Bearer nope"}):
        anonymous = httpx.get(server.url + "/readyz", headers=headers, timeout=5)
        assert anonymous.status_code == 200 and anonymous.json() == {"status": "ready"}
        assert "text-vllm" not in anonymous.text
    detail = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5).json()
    assert detail["engines"]["text-vllm"] and detail["policies"]["pre"] == [
        "request-limits",
        "media-fetch",
        "media-limits",
    ]


def test_metrics_on_a_port_of_their_own(started):
    server = started(metrics={"port": 0})
    assert httpx.get(server.url + "/metrics", timeout=5).status_code == 404
    port = server.services.metrics_server.port
    assert port and port != server.port
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "omnigate_requests_in_flight" in body and "omnigate_directory_fresh" in body
