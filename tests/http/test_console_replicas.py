"""The console as it is deployed: two gateways on one PostgreSQL audit store and one Redis routing state.

A console session signed in on one replica acts on the other; a pin made through
one shows in the other's table and history; each finds the other's request
records; a range verify covers what both wrote; a hot reload keeps the session
and shows the new config; a shadow policy's verdict is searchable and shown.
"""

from __future__ import annotations

import re

import httpx
import pytest
import yaml

from gateway.api import console_session as session
from tests.console_setup import ADMIN, ADMIN_KEY, OMNI, SIGNING_KEY, config, request_id, start, tenant_keys
from tests.harness import wait_until
from tests.stores import fresh_pg_database, redis_prefix

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair(bg, eng, tmp_path):
    keys = tenant_keys()
    prefix = redis_prefix()
    with fresh_pg_database() as dsn:
        servers, docs = [], []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            doc = config(
                eng,
                tmp_path / name,
                keys,
                audit={"store": "postgres", "postgres_dsn": dsn, "signing": {"key": SIGNING_KEY}},
                state={"backend": "redis", "key_prefix": prefix, "replica_id": f"replica-{name}"},
            )
            docs.append(doc)
            servers.append(start(bg, doc, tmp_path / name / "omnigate.yaml"))
        try:
            yield servers, docs, keys, tmp_path
        finally:
            for s in servers:
                s.stop()


def _signed_in(server) -> tuple[httpx.Client, str]:
    c = httpx.Client(base_url=server.url, timeout=10)
    assert c.post("/admin/console/login", data={"key": ADMIN_KEY}).status_code == 303
    token = re.search(
        r'name="csrf-token" content="([A-Za-z0-9_-]{43})"', c.get("/admin/console/overview").text
    ).group(1)
    return c, token


def test_a_session_on_one_replica_pins_and_both_see_it(pair):
    (a, b), _, keys, _ = pair
    ca, token = _signed_in(a)
    cb = httpx.Client(base_url=b.url, timeout=10, cookies={session.COOKIE: ca.cookies.get(session.COOKIE)})
    with cb:
        r = cb.post(
            "/admin/routing/pin",
            json={"model": OMNI, "variant": "bf16", "actor": "console"},
            headers={"x-csrf-token": token},
        )
        assert r.status_code == 200 and r.json()["changed"]
        # the table is shared through Redis, the history through the audit chain in PostgreSQL
        assert wait_until(lambda: ca.get("/admin/routing").json()["pins"] == {OMNI: "bf16"}, timeout=10)
        for c in (ca, cb):
            history = c.get("/admin/routing/transitions").json()
            assert history["source"] == "audit"
            pins = [t for t in history["transitions"] if t["action"] == "pin"]
            assert len(pins) == 1 and pins[0]["detail"]["actor"] == "admin:console-session (claimed: console)"

        rid = request_id(b, keys["acme"].key)
        assert wait_until(
            lambda: ca.get("/admin/audit/records", params={"request_id": rid}).json()["records"], timeout=10
        )
        head = ca.get("/admin/audit/records", params={"limit": 1}).json()["records"][0]["seq"]
        report = cb.get("/admin/audit/verify/range", params={"from_seq": 1, "to_seq": head})
        assert report.status_code == 200 and report.json()["records"] == head
    ca.close()


def test_a_hot_reload_keeps_the_session_and_the_console_shows_the_new_config(pair):
    (a, _), docs, _, tmp_path = pair
    ca, token = _signed_in(a)
    doc = {**docs[0], "tenants": [*docs[0]["tenants"], {"name": "initech", "policy_set": "strict"}]}
    (tmp_path / "a" / "omnigate.yaml").write_text(yaml.safe_dump(doc))
    checked = ca.post("/admin/config/check", headers={"x-csrf-token": token}).json()
    assert checked["ok"] and checked["applies_at_once"] == ["tenants"]
    assert ca.post("/admin/config/reload", headers={"x-csrf-token": token}).status_code == 200
    tenants = {t["name"]: t for t in ca.get("/admin/config").json()["tenants"]}
    assert tenants["initech"]["chain"]["pre"] == [
        "request-limits",
        "request-limits (shadow)",
        "media-fetch",
        "media-limits",
    ]
    assert ca.get("/admin/console/config").status_code == 200
    ca.close()


def test_a_shadow_verdict_is_recorded_searchable_and_does_not_act(pair):
    (a, b), _, keys, _ = pair
    # two messages: strict's enforced limit (8) lets it through; its shadow limit (1) would have refused it
    rid = request_id(b, keys["globex"].key, messages=2)

    def record():
        found = httpx.get(a.url + "/admin/audit/records", params={"request_id": rid}, headers=ADMIN).json()
        return found["records"]

    assert wait_until(record, timeout=10)
    seq = record()[0]["seq"]
    runs = httpx.get(f"{a.url}/admin/audit/records/{seq}", headers=ADMIN).json()["data"]["payload"][
        "policies"
    ]
    shadow = [p for p in runs if p["shadow"]]
    assert len(shadow) == 1 and shadow[0]["name"] == "request-limits"
    verdict = shadow[0]["verdict"]
    assert verdict != next(p for p in runs if not p["shadow"])["verdict"]
    hits = httpx.get(
        a.url + "/admin/audit/records",
        params={"policy": "request-limits", "verdict": verdict, "tenant": "globex"},
        headers=ADMIN,
    ).json()["records"]
    assert rid in [h["request_id"] for h in hits] and hits[0]["outcome"] == "served"
    assert f"request-limits:{verdict} (shadow)" in hits[0]["policies"]
