"""The admin API's read views: audit search, one record, export, range verify, transitions, traffic, config.

Each runs against a real gateway on its own scripted engines, on SQLite and on
PostgreSQL (the two audit stores implement search in their own SQL).
"""

from __future__ import annotations

import sqlite3

import httpx
import orjson
import pytest
import yaml

from tests.console_setup import (
    ADMIN_KEY,
    OMNI,
    SIGNING_KEY,
    admin,
    chat,
    config,
    request_id,
    start,
    tenant_keys,
)
from tests.harness import wait_until
from tests.stores import fresh_pg_database

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "postgres"])
def gw(request, bg, eng, tmp_path):
    keys = tenant_keys()
    if request.param == "postgres":
        with fresh_pg_database() as dsn:
            doc = config(
                eng,
                tmp_path,
                keys,
                audit={"store": "postgres", "postgres_dsn": dsn, "signing": {"key": SIGNING_KEY}},
            )
            server = start(bg, doc, tmp_path / "omnigate.yaml")
            yield server, keys, doc, tmp_path / "omnigate.yaml"
            server.stop()
    else:
        doc = config(eng, tmp_path, keys)
        server = start(bg, doc, tmp_path / "omnigate.yaml")
        yield server, keys, doc, tmp_path / "omnigate.yaml"
        server.stop()


def _traffic(server, keys) -> dict[str, str]:
    """Three requests of acme, two of globex (one refused by its policy set); their request ids."""
    ids = {}
    for _ in range(3):
        rid = request_id(server, keys["acme"].key)
        ids[rid] = "served"
    rid = request_id(server, keys["globex"].key)
    ids[rid] = "served"
    rid = request_id(server, keys["globex"].key, 400, messages=9)
    ids[rid] = "refused"
    return ids


def _records(server, **params) -> dict:
    r = admin(server, "GET", "/audit/records", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _all_requests_written(server, n: int) -> None:
    assert wait_until(lambda: len(_records(server, kind="request")["records"]) >= n, timeout=10)


def test_search_by_every_filter_and_page_through(gw):
    server, keys, _, _ = gw
    ids = _traffic(server, keys)
    _all_requests_written(server, 5)

    acme = _records(server, tenant="acme", kind="request")["records"]
    assert len(acme) == 3 and {r["tenant"] for r in acme} == {"acme"}
    assert [r["seq"] for r in acme] == sorted((r["seq"] for r in acme), reverse=True)  # newest first

    rid = next(iter(ids))
    one = _records(server, request_id=rid)["records"]
    assert [r["request_id"] for r in one] == [rid]
    assert one[0]["outcome"] == "served" and one[0]["engine"] == "text-vllm" and one[0]["status"] == 200

    refused = _records(server, outcome="refused")["records"]
    assert [r["request_id"] for r in refused] == [k for k, v in ids.items() if v == "refused"]
    assert {r["request_id"] for r in _records(server, engine="text-vllm")["records"]} == {
        k for k, v in ids.items() if v == "served"
    }

    full = admin(server, "GET", f"/audit/records/{one[0]['seq']}").json()
    run = full["data"]["payload"]["policies"][0]
    assert run["name"] == "request-limits"
    matched = _records(server, policy="request-limits", verdict=run["verdict"], tenant="acme")["records"]
    assert len(matched) == 3
    assert _records(server, policy="request-limits", verdict="no-such-verdict")["records"] == []
    assert _records(server, policy="no-such-policy")["records"] == []
    assert _records(server, degraded="load-text-only")["records"] == []

    # time range: everything is after a minute ago, nothing is before it
    all_requests = _records(server, kind="request")["records"]
    first_ts = min(r["ts"] for r in all_requests)
    assert len(_records(server, kind="request", since=first_ts)["records"]) == 5
    assert _records(server, kind="request", until=first_ts)["records"] == []
    assert _records(server, kind="request", since="2999-01-01T00:00:00Z")["records"] == []

    # paging: pages of two, disjoint, in order, ending with no cursor
    seen, cursor = [], None
    while True:
        page = _records(server, kind="request", limit=2, **({"before_seq": cursor} if cursor else {}))
        seen += [r["seq"] for r in page["records"]]
        cursor = page["next_before_seq"]
        if cursor is None:
            break
    assert seen == [r["seq"] for r in all_requests] and len(set(seen)) == 5


@pytest.mark.parametrize(
    "params, param",
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "501"}, "limit"),
        ({"before_seq": "x"}, "before_seq"),
        ({"since": "yesterday-ish"}, "since"),
        ({"colour": "red"}, "colour"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, None),
        # beyond what the stores' 64-bit integers and Python's datetimes hold: 400s, never 500s
        ({"before_seq": str(2**63)}, "before_seq"),
        ({"before_seq": "9" * 30}, "before_seq"),
        ({"since": "0001-01-01T00:00:00+01:00"}, "since"),
        ({"until": "9999-12-31T23:59:59-05:00"}, "until"),
    ],
)
def test_bad_search_parameters_are_400s_naming_the_field(gw, params, param):
    server = gw[0]
    r = admin(server, "GET", "/audit/records", params=params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


def test_records_need_the_admin_key(gw):
    server = gw[0]
    for path in ("/records", "/records/1", "/export", "/verify/range?from_seq=1&to_seq=2"):
        r = httpx.get(server.url + "/admin/audit" + path, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(
            server.url + "/admin/audit/records",
            headers={"authorization": "Bearer wrong-key-0123456789"},
            timeout=5,
        ).status_code
        == 401
    )


def test_one_record_and_missing_ones(gw):
    server, keys, _, _ = gw
    rid = request_id(server, keys["acme"].key)
    assert wait_until(lambda: _records(server, request_id=rid)["records"], timeout=10)
    seq = _records(server, request_id=rid)["records"][0]["seq"]
    r = admin(server, "GET", f"/audit/records/{seq}").json()
    assert r["seq"] == seq and r["request_id"] == rid and len(r["hash"]) == 64 and len(r["prev_hash"]) == 64
    assert r["data"]["payload"]["key_id"] == keys["acme"].id
    assert "input" in r["data"]["payload"] and "output" in r["data"]["payload"]
    missing = admin(server, "GET", "/audit/records/999999")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert admin(server, "GET", "/audit/records/0").status_code == 404
    assert admin(server, "GET", "/audit/records/abc").status_code == 400
    huge = admin(server, "GET", f"/audit/records/{2**63}")
    assert huge.status_code == 400 and huge.json()["error"]["type"] == "invalid_request_error"


def test_export_streams_the_selection_as_json_lines_and_is_recorded(gw):
    server, keys, _, _ = gw
    _traffic(server, keys)
    _all_requests_written(server, 5)
    r = admin(server, "GET", "/audit/export", params={"tenant": "acme", "kind": "request"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert "attachment" in r.headers["content-disposition"]
    lines = [orjson.loads(line) for line in r.content.splitlines()]
    assert len(lines) == 3 and {x["tenant"] for x in lines} == {"acme"}
    assert [x["seq"] for x in lines] == sorted(x["seq"] for x in lines)  # oldest first, like the CLI
    assert all(len(x["hash"]) == 64 and x["data"]["kind"] == "request" for x in lines)
    events = _records(server, kind="audit_export")["records"]
    assert events and events[0]["action"] is None
    detail = admin(server, "GET", f"/audit/records/{events[0]['seq']}").json()
    assert detail["data"]["payload"]["filters"] == {"tenant": "acme", "kind": "request"}


def _tamper(server, doc, seq: int, sql: str) -> None:
    """Change the stored chain underneath the running gateway (an attacker with write access to the store)."""
    audit = doc["audit"]
    if audit.get("store") == "postgres":
        import asyncpg

        async def run() -> None:
            conn = await asyncpg.connect(audit["postgres_dsn"])
            try:
                await conn.execute(sql.replace("?", "$1"), seq)
            finally:
                await conn.close()

        server.bg.run(run())
    else:
        db = sqlite3.connect(audit["sqlite_path"])
        db.execute(sql, (seq,))
        db.commit()
        db.close()


def test_verify_a_range_and_see_where_the_chain_breaks(gw):
    server, keys, doc, _ = gw
    _traffic(server, keys)
    _all_requests_written(server, 5)
    head = _records(server, limit=1)["records"][0]["seq"]
    ok = admin(server, "GET", "/audit/verify/range", params={"from_seq": 1, "to_seq": head})
    assert ok.status_code == 200 and ok.json()["ok"] and ok.json()["records"] >= head - 1

    target = _records(server, tenant="acme", kind="request")["records"][1]["seq"]
    _tamper(
        server,
        doc,
        target,
        "UPDATE audit_log SET data = replace(data, '\"status\":200', '\"status\":201') WHERE seq = ?",
    )
    broken = admin(server, "GET", "/audit/verify/range", params={"from_seq": 1, "to_seq": head})
    assert broken.status_code == 409
    problem = broken.json()["problem"]
    assert problem["kind"] == "edited" and problem["seq"] == target and str(target) in problem["message"]
    assert broken.json()["range"] == {"from_seq": 1, "to_seq": head}
    # the same break is found by a range that starts right after the edited record's predecessor...
    assert (
        admin(server, "GET", "/audit/verify/range", params={"from_seq": target, "to_seq": target}).json()[
            "problem"
        ]["seq"]
        == target
    )
    # ...and ranges that do not include it (nor its successor, whose link it anchors) verify
    assert admin(server, "GET", "/audit/verify/range", params={"from_seq": 1, "to_seq": target - 1}).json()[
        "ok"
    ]
    later = admin(
        server, "GET", "/audit/verify/range", params={"from_seq": target + 2, "to_seq": head}
    ).json()
    assert later["ok"], later
    # the full walk agrees
    assert admin(server, "GET", "/audit/verify").json()["problem"]["seq"] == target


def test_verify_range_finds_a_deleted_record(gw):
    server, keys, doc, _ = gw
    _traffic(server, keys)
    _all_requests_written(server, 5)
    head = _records(server, limit=1)["records"][0]["seq"]
    gone = _records(server, kind="request")["records"][2]["seq"]
    _tamper(server, doc, gone, "DELETE FROM audit_log WHERE seq = ?")
    r = admin(server, "GET", "/audit/verify/range", params={"from_seq": 1, "to_seq": head})
    assert r.status_code == 409 and r.json()["problem"] == {
        "kind": "deleted",
        "seq": gone,
        "message": f"record {gone} is missing (deleted)",
    }
    starts_there = admin(server, "GET", "/audit/verify/range", params={"from_seq": gone + 1, "to_seq": head})
    assert starts_there.status_code == 409 and starts_there.json()["problem"]["seq"] == gone


@pytest.mark.parametrize(
    "params",
    [
        {"from_seq": 5, "to_seq": 2},
        {"from_seq": 0, "to_seq": 2},
        {"from_seq": 1},
        {"from_seq": 1, "to_seq": 2**63},
        {"from_seq": "x", "to_seq": 2},
    ],
)
def test_bad_ranges_are_400s(gw, params):
    r = admin(gw[0], "GET", "/audit/verify/range", params=params)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_transition_history_comes_from_the_audit_trail(gw):
    server = gw[0]
    r = admin(
        server,
        "POST",
        "/routing/pin",
        json={"model": OMNI, "variant": "bf16", "actor": "alice", "note": "int4 regression"},
    )
    assert r.status_code == 200 and r.json()["changed"]
    admin(server, "POST", "/routing/freeze", json={"actor": "alice"})

    def latest():
        return admin(server, "GET", "/routing/transitions", params={"limit": 2}).json()

    assert wait_until(lambda: len(latest()["transitions"]) == 2, timeout=10)
    body = latest()
    assert body["source"] == "audit"
    freeze, pin = body["transitions"]
    assert freeze["action"] == "freeze" and pin["action"] == "pin" and pin["source"] == "manual"
    assert (
        pin["detail"]["actor"] == "admin:api_key (claimed: alice)"
        and pin["detail"]["note"] == "int4 regression"
    )
    assert pin["detail"]["weights"][OMNI]["omni-bf16"] == 1.0 and pin["seq"] < freeze["seq"]
    older = admin(server, "GET", "/routing/transitions", params={"before_seq": pin["seq"]}).json()[
        "transitions"
    ]
    assert all(t["seq"] < pin["seq"] for t in older)
    assert admin(server, "GET", "/routing/transitions", params={"limit": "x"}).status_code == 400
    assert admin(server, "GET", "/routing/transitions", params={"before_seq": 2**63}).status_code == 400


def test_transition_history_without_audit_is_this_replicas(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys(), audit={"enabled": False})
    doc["tenants"], doc["api_keys"] = [], []
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        admin(server, "POST", "/routing/pin", json={"model": OMNI, "variant": "bf16"})
        body = admin(server, "GET", "/routing/transitions").json()
        assert body["source"] == "replica" and body["transitions"][0]["action"] == "pin"
        assert admin(server, "GET", "/audit/records").status_code == 409
    finally:
        server.stop()


def test_traffic_shows_the_admission_state(gw):
    server, keys, _, _ = gw
    assert chat(server, keys["acme"].key).status_code == 200
    t = admin(server, "GET", "/traffic").json()
    assert t["enabled"] and t["store"] == "local" and t["in_flight"] == 0 and not t["overloaded"]
    assert t["soft_limit"] < t["hard_limit"]
    assert [p["name"] for p in t["priorities"]] == ["interactive", "standard", "batch"]
    assert set(t["shed"]) == {"text_only", "tenant_quota", "overload", "engine_busy"}


def test_config_view_and_check_swap_nothing(gw):
    server, _, doc, path = gw
    c = admin(server, "GET", "/config").json()
    assert [e["name"] for e in c["engines"]] == ["omni-int4", "omni-bf16", "text-vllm", "spare-vllm"]
    assert all("api_key" not in e for e in c["engines"])
    assert (
        c["policies"]["pre"] == ["request-limits", "media-fetch", "media-limits"]
        and "strict" in c["policy_sets"]
    )
    by_name = {t["name"]: t for t in c["tenants"]}
    assert by_name["globex"]["policy_set"] == "strict" and by_name["acme"]["policy_set"] is None
    assert c["reloadable"]

    same = admin(server, "POST", "/config/check").json()
    assert same["ok"] and same["applies_at_once"] == [] and same["restart_required"] == []

    doc2 = {**doc, "tenants": [*doc["tenants"], {"name": "initech"}]}
    path.write_text(yaml.safe_dump(doc2))
    checked = admin(server, "POST", "/config/check").json()
    assert checked["ok"] and checked["applies_at_once"] == ["tenants"]
    assert "initech" not in {t["name"] for t in admin(server, "GET", "/tenants").json()["tenants"]}

    doc3 = {**doc, "tenants": [{"name": "acme", "priority": "vip"}]}
    path.write_text(yaml.safe_dump(doc3))
    bad = admin(server, "POST", "/config/check").json()
    assert not bad["ok"] and "priority" in bad["message"]
    assert admin(server, "GET", "/config").json()["tenants"] == c["tenants"]  # still the running config
    assert ADMIN_KEY not in admin(server, "GET", "/config").text
    path.write_text(yaml.safe_dump(doc))
