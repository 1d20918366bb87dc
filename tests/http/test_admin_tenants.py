"""The admin API for tenants and keys (backed by the audit database) and config hot reload."""

from __future__ import annotations

import secrets

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.settings import load_settings
from gateway.tenants import mint_key
from tests.conftest import OMNI_MODEL, TEXT_MODEL
from tests.harness import GatewayServer, wait_until
from tests.stores import redis_prefix

pytestmark = pytest.mark.timeout(60)
ADMIN_KEY = secrets.token_hex(32)  # the boot refuses typed keys
SIGNING_KEY = secrets.token_hex(32)
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _config(base_url, tmp_path, tenants, keys, *, policy_sets=None, read_timeout_s=5) -> dict:
    return {
        "engines": [
            {
                "name": "text-vllm",
                "kind": "vllm",
                "base_url": base_url,
                "model": "scripted",
                "variant": "fp16",
                "serves": [TEXT_MODEL],
                "read_timeout_s": read_timeout_s,
            }
        ],
        "admin": {"api_key": ADMIN_KEY},
        "policy_sets": policy_sets or {"plain": {"pre": [{"name": "request-limits"}]}},
        "tenants": tenants,
        "api_keys": keys,
        "rate_limits": {"key_prefix": redis_prefix()},
        "audit": {"sqlite_path": str(tmp_path / "audit.db"), "signing": {"key": SIGNING_KEY}},
        "logging": {"level": "warning"},
    }


@pytest.fixture
def setup(bg, upstreams, tmp_path):
    upstreams.reset()
    base = mint_key()
    path = tmp_path / "omnigate.yaml"
    doc = _config(
        upstreams.vllm.base_url,
        tmp_path,
        [{"name": "base"}],
        [{"id": base.id, "tenant": "base", "sha256": base.sha256}],
    )
    path.write_text(yaml.safe_dump(doc))
    server = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
    yield server, path, doc, base
    server.stop()


def _chat(server, key) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


def _admin(server, method, path, **kw) -> httpx.Response:
    return httpx.request(method, server.url + "/admin" + path, headers=ADMIN, timeout=10, **kw)


def test_tenants_and_keys_through_the_admin_api(setup):
    server, _, _, base = setup
    assert httpx.get(server.url + "/admin/tenants").status_code == 401
    listed = _admin(server, "GET", "/tenants").json()["tenants"]
    assert [(t["name"], t["source"]) for t in listed] == [("base", "config")]

    created = _admin(
        server, "POST", "/tenants", json={"name": "newco", "models": [TEXT_MODEL], "requests_per_minute": 100}
    )
    assert created.status_code == 201 and created.json()["source"] == "admin"
    assert _admin(server, "POST", "/tenants", json={"name": "newco"}).status_code == 409
    bad_set = _admin(server, "POST", "/tenants", json={"name": "x", "policy_set": "nope"})
    assert bad_set.status_code == 422 and bad_set.json()["error"]["param"] == "policy_set"
    bad_class = _admin(server, "POST", "/tenants", json={"name": "z", "priority": "vip"})
    assert bad_class.status_code == 422 and bad_class.json()["error"]["param"] == "priority"
    bad_value = _admin(server, "POST", "/tenants", json={"name": "y", "requests_per_minute": 0})
    assert bad_value.status_code == 400 and bad_value.json()["error"]["param"] == "requests_per_minute"
    assert _admin(server, "PUT", "/tenants/base", json={"name": "base"}).status_code == 409

    minted = _admin(server, "POST", "/keys", json={"tenant": "newco"})
    assert minted.status_code == 201
    key, key_id = minted.json()["key"], minted.json()["id"]
    assert _chat(server, key).status_code == 200
    keys = _admin(server, "GET", "/keys")
    assert key not in keys.text and "sha256" not in keys.text
    assert {(k["id"], k["source"]) for k in keys.json()["keys"]} == {(key_id, "admin"), (base.id, "config")}
    assert _admin(server, "POST", "/keys", json={"tenant": "ghost"}).status_code == 404

    assert _admin(server, "DELETE", f"/keys/{key_id}").json()["enabled"] is False
    assert _chat(server, key).status_code == 401
    assert _admin(server, "DELETE", f"/keys/{base.id}").status_code == 409

    # A disabled tenant's keys stop working too.
    again = _admin(server, "POST", "/keys", json={"tenant": "newco"}).json()["key"]
    assert _chat(server, again).status_code == 200
    assert (
        _admin(server, "PUT", "/tenants/newco", json={"name": "newco", "enabled": False}).status_code == 200
    )
    assert _chat(server, again).status_code == 401

    # Every change is on the audit chain, which verifies.
    report = _admin(server, "GET", "/audit/verify").json()
    assert report["ok"], report
    rows = server.bg.run(server.services.audit.store.rows(0, 1000))
    actions = [r.to_json()["data"]["payload"].get("action") for r in rows if r.kind == "admin_change"]
    assert actions == ["tenant_created", "key_created", "key_revoked", "key_created", "tenant_updated"]
    assert key not in str([r.data for r in rows])


def test_reload_validates_first_and_keeps_the_old_config(setup):
    server, path, doc, base = setup
    later = mint_key()
    bad = {**doc, "tenants": [{"name": "base"}, {"name": "later", "policy_set": "missing"}]}
    path.write_text(yaml.safe_dump(bad))
    refused = _admin(server, "POST", "/config/reload")
    assert refused.status_code == 422
    err = refused.json()["error"]
    assert err["code"] == "invalid_config" and "tenants[1].policy_set" in err["message"]
    assert _chat(server, base.key).status_code == 200  # still the old config
    unknown_class = {**doc, "tenants": [{"name": "base", "priority": "vip"}]}
    path.write_text(yaml.safe_dump(unknown_class))
    err = _admin(server, "POST", "/config/reload").json()["error"]
    assert err["code"] == "invalid_config" and "tenants[0].priority" in err["message"]

    path.write_text("engines: [unclosed")
    assert _admin(server, "POST", "/config/reload").status_code == 422

    good = _config(
        doc["engines"][0]["base_url"],
        path.parent,
        [{"name": "base"}, {"name": "later"}],
        [
            {"id": base.id, "tenant": "base", "sha256": base.sha256},
            {"id": later.id, "tenant": "later", "sha256": later.sha256},
        ],
        read_timeout_s=9,
    )
    good["rate_limits"] = doc["rate_limits"]
    path.write_text(yaml.safe_dump(good))
    assert _chat(server, later.key).status_code == 401
    ok = _admin(server, "POST", "/config/reload")
    assert ok.status_code == 200, ok.text
    assert ok.json()["restart_required"] == ["engines"]
    assert _chat(server, later.key).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'omnigate_config_reloads_total{result="failed"} 3.0' in metrics
    assert 'omnigate_config_reloads_total{result="ok"} 1.0' in metrics


def test_an_admin_tenants_audio_limit_is_refused_where_its_chain_could_pass_audio_uncounted(setup):
    # The config's tenants are checked as the file loads; a tenant written through the admin API, and a
    # reload that changes the chain of one already written, must meet the same rule.
    server, path, doc, _ = setup
    measured = {"pre": [{"name": "media-limits"}]}
    open_ = {"pre": [{"name": "media-limits", "on_error": "fail_open"}]}
    first = {**doc, "policy_sets": {"measured": measured, "open": open_}}
    path.write_text(yaml.safe_dump(first))
    assert _admin(server, "POST", "/config/reload").status_code == 200

    refused = _admin(
        server,
        "POST",
        "/tenants",
        json={"name": "talker", "policy_set": "open", "audio_seconds_per_minute": 60},
    )
    assert refused.status_code == 422, refused.text
    err = refused.json()["error"]
    assert err["param"] == "audio_seconds_per_minute" and "uncounted" in err["message"]
    assert "talker" not in [t["name"] for t in _admin(server, "GET", "/tenants").json()["tenants"]]
    # Without the limit the chain is the tenant's choice; with it, a measuring chain.
    assert _admin(server, "POST", "/tenants", json={"name": "quiet", "policy_set": "open"}).status_code == 201
    made = _admin(
        server,
        "POST",
        "/tenants",
        json={"name": "talker", "policy_set": "measured", "audio_seconds_per_minute": 60},
    )
    assert made.status_code == 201, made.text
    moved = _admin(
        server,
        "PUT",
        "/tenants/talker",
        json={"name": "talker", "policy_set": "open", "audio_seconds_per_minute": 60},
    )
    assert moved.status_code == 422 and moved.json()["error"]["param"] == "audio_seconds_per_minute"

    # A reload that turns the written tenant's chain open is refused, and the old config stays.
    path.write_text(yaml.safe_dump({**doc, "policy_sets": {"measured": open_, "open": open_}}))
    refused = _admin(server, "POST", "/config/reload")
    assert refused.status_code == 422
    err = refused.json()["error"]
    assert err["code"] == "invalid_config"
    assert "'talker'" in err["message"] and "audio_seconds_per_minute" in err["message"]
    assert not any(s.on_error == "fail_open" for s in server.services.settings.policy_sets["measured"].pre)


def test_a_replica_whose_chain_cannot_measure_an_admin_tenants_audio_refuses_its_audio(
    bg, upstreams, tmp_path
):
    """Two replicas on one PostgreSQL directory, mid-rollout: the first's policy set ``voice`` measures every
    audio part, the second's (a newer config) runs media-limits failing open. A tenant written through the
    first, with an audio limit on ``voice``, is read by the second, which never checked it: there, its audio
    input could be served uncounted, so it is refused (503 ``audio_limit_unmeasured``) while its text is
    served; on the first, both are."""
    from tests.stores import fresh_pg_database

    upstreams.reset()
    measured = {"pre": [{"name": "media-limits"}]}
    opened = {"pre": [{"name": "media-limits", "on_error": "fail_open"}]}
    audio = {"type": "input_audio", "input_audio": {"data": _wav_b64(), "format": "wav"}}
    with fresh_pg_database() as dsn:
        servers = []
        for name, voice in (("a", measured), ("b", opened)):
            doc = _config(upstreams.vllm.base_url, tmp_path / name, [], [], policy_sets={"voice": voice})
            doc["auth"] = {"directory": {"backend": "postgres", "postgres_dsn": dsn, "refresh_s": 0.2}}
            # an engine that takes audio: on the second replica, without the refusal, the audio is served
            doc["engines"].append(
                {
                    "name": "omni",
                    "kind": "vllm-omni",
                    "base_url": upstreams.omni_a.base_url,
                    "model": "scripted",
                    "serves": [OMNI_MODEL],
                }
            )
            (tmp_path / name).mkdir()
            path = tmp_path / name / "omnigate.yaml"
            path.write_text(yaml.safe_dump(doc))
            servers.append(
                GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()
            )
        a, b = servers
        try:
            made = _admin(
                a,
                "POST",
                "/tenants",
                json={"name": "talker", "policy_set": "voice", "audio_seconds_per_minute": 60},
            )
            assert made.status_code == 201, made.text
            key = _admin(a, "POST", "/keys", json={"tenant": "talker"}).json()["key"]

            def ask(server, content) -> httpx.Response:
                return httpx.post(
                    server.url + "/v1/chat/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": OMNI_MODEL, "messages": [{"role": "user", "content": content}]},
                    timeout=10,
                )

            assert wait_until(lambda: ask(b, "hi").status_code == 200, timeout=10)  # b has read the tenant
            refused = ask(b, [{"type": "text", "text": "listen"}, audio])
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "audio_limit_unmeasured"
            assert "fail_open" not in refused.text and "media-limits" not in refused.text  # no config leaked
            served = ask(a, [{"type": "text", "text": "listen"}, audio])
            assert served.status_code == 200, served.text  # measured where its chain can
        finally:
            for s in servers:
                s.stop()


def _wav_b64() -> str:
    import base64
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x10" * 8000)
    return base64.b64encode(buf.getvalue()).decode()
