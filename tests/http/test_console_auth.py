"""The console's front door: off by default, sign-in for a session cookie, CSRF on every change, a strict CSP.

Attacks first: a forged, expired or foreign cookie; a change without the CSRF
token, with a wrong one, or from another origin; the console's cookie on a
gateway whose console is off; a session surviving a change of the admin key.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time

import httpx
import pytest
import yaml
from itsdangerous.encoding import base64_decode, base64_encode
from pydantic import ValidationError

from gateway.api import console_session as session
from gateway.console.routes import CSP
from gateway.settings import Settings
from tests.console_setup import ADMIN, ADMIN_KEY, config, start, tenant_keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gw(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys())
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    yield server, doc, tmp_path / "omnigate.yaml"
    server.stop()


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=10, follow_redirects=False)


def _sign_in(c: httpx.Client, key: str = ADMIN_KEY, **headers: str) -> httpx.Response:
    return c.post("/admin/console/login", data={"key": key}, headers=headers)


def _csrf(c: httpx.Client) -> str:
    page = c.get("/admin/console/overview")
    assert page.status_code == 200
    return re.search(r'<meta name="csrf-token" content="([A-Za-z0-9_-]{43})">', page.text).group(1)


def test_console_is_off_by_default_and_its_cookie_opens_nothing(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys(), console=False)
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        with _client(server) as c:
            for path in ("", "/login", "/overview", "/audit", "/static/console.js"):
                r = c.get("/admin/console" + path)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            assert _sign_in(c).status_code == 404
            # A cookie that would be valid with the console on is not a credential while it is off.
            c.cookies.set(session.COOKIE, session.issue(ADMIN_KEY, 600), path="/admin")
            assert c.get("/admin/engines").status_code == 401
    finally:
        server.stop()


def test_console_without_an_admin_key_is_refused_at_start_up():
    with pytest.raises(ValidationError, match=re.escape("admin.console.enabled needs admin.api_key")):
        Settings(admin={"console": {"enabled": True}})


def test_sign_in_sets_a_strict_session_cookie(gw):
    server = gw[0]
    with _client(server) as c:
        r = c.get("/admin/console/overview")
        assert r.status_code == 303 and r.headers["location"] == "/admin/console/login"
        wrong = _sign_in(c, "not-the-admin-key-at-all")
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        assert "That is not the admin key." in wrong.text and "not-the-admin-key" not in wrong.text
        assert (
            server.registry.get_sample_value("omnigate_auth_failures_total", {"reason": "console_sign_in"})
            == 1
        )
        ok = _sign_in(c)
        assert ok.status_code == 303 and ok.headers["location"] == "/admin/console/overview"
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith(session.COOKIE + "=")
        flags = {f.strip().lower() for f in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/admin"} <= flags
        assert "secure" not in flags  # plain HTTP: a Secure cookie would never come back
        assert ADMIN_KEY not in cookie
        page = c.get("/admin/console/overview")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        assert ADMIN_KEY not in page.text
        assert c.get("/admin/engines").status_code == 200  # the admin API takes the session


def test_the_cookie_is_secure_behind_tls(gw):
    server = gw[0]
    with _client(server) as c:
        # uvicorn trusts X-Forwarded-Proto from 127.0.0.1 (its default forwarded_allow_ips), as from a TLS proxy
        r = _sign_in(c, **{"x-forwarded-proto": "https"})
        assert r.status_code == 303
        assert "secure" in {f.strip().lower() for f in r.headers["set-cookie"].split(";")[1:]}


def test_csp_forbids_inline_script_and_other_hosts(gw):
    for directive in (
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
        "form-action 'self'",
        "base-uri 'none'",
    ):
        assert directive in CSP
    assert "unsafe" not in CSP and "http" not in CSP
    server = gw[0]
    with _client(server) as c:
        _sign_in(c)
        for name in ("overview", "rollback", "tenants", "audit", "config"):
            html = c.get(f"/admin/console/{name}").text
            # no inline script or style, no external reference: every src and href is relative to the gateway
            assert re.search(r"<script(?![^>]*\bsrc=)", html) is None and "style=" not in html
            assert all(not u.startswith(("http", "//")) for u in re.findall(r'(?:src|href)="([^"]*)"', html))
        js = c.get("/admin/console/static/console.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in js.text and "eval(" not in js.text and "http" not in js.text
        assert c.get("/admin/console/static/..%2Fsession.py").status_code == 404
        assert c.get("/admin/console/static/nope.js").status_code == 404
        assert c.get("/admin/console/nope").status_code == 404


def test_changes_need_the_csrf_token(gw):
    server = gw[0]
    with _client(server) as c:
        _sign_in(c)
        token = _csrf(c)
        refused = [
            c.post("/admin/routing/freeze", json={}),
            c.post("/admin/routing/freeze", json={}, headers={"x-csrf-token": "A" * 43}),
            c.post(
                "/admin/routing/freeze",
                json={},
                headers={"x-csrf-token": token, "origin": "https://evil.example"},
            ),
            c.post("/admin/keys", json={"tenant": "acme"}),
            c.delete("/admin/keys/abcdefgh1234"),
            c.post("/admin/console/logout"),
        ]
        for r in refused:
            assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", r.text
        assert not httpx.get(server.url + "/admin/routing", headers=ADMIN).json()["frozen"]
        assert {k["source"] for k in httpx.get(server.url + "/admin/keys", headers=ADMIN).json()["keys"]} == {
            "config"
        }
        ok = c.post(
            "/admin/routing/freeze",
            json={"actor": "console"},
            headers={"x-csrf-token": token, "origin": server.url},
        )
        assert ok.status_code == 200 and ok.json()["frozen"]
        # a token is bound to its session: another sign-in's token does not fit this cookie
        with _client(server) as other:
            _sign_in(other)
            theirs = _csrf(other)
        assert theirs != token
        assert c.post("/admin/routing/resume", json={}, headers={"x-csrf-token": theirs}).status_code == 403


def test_forged_expired_and_foreign_cookies_are_refused(gw):
    server = gw[0]
    good = session.issue(ADMIN_KEY, 600)
    # a changed signature (its first character: the last one carries two bits that decoding ignores)
    payload, signature = good.rsplit(".", 1)
    forged = f"{payload}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    expired = session.issue(ADMIN_KEY, 600, now=time.time() - 3600)
    foreign = session.issue("some-other-gateways-admin-key", 600)
    # the same signature on a payload whose expiry was pushed out
    claims = json.loads(base64_decode(payload))
    longer = base64_encode(json.dumps({**claims, "e": claims["e"] + 10**6})).decode() + "." + signature
    for value in (forged, expired, foreign, longer, "v1.99999999999.x.y", "garbage", "." * 300):
        with _client(server) as c:
            c.cookies.set(session.COOKIE, value, path="/admin")
            assert c.get("/admin/engines").status_code == 401
            assert c.get("/admin/console/overview").status_code == 303
    with _client(server) as c:
        c.cookies.set(session.COOKIE, good, path="/admin")
        assert c.get("/admin/engines").status_code == 200


def test_sign_in_from_another_origin_or_oversized_is_refused(gw):
    server = gw[0]
    with _client(server) as c:
        r = _sign_in(c, origin="https://evil.example")
        assert r.status_code == 403 and "set-cookie" not in r.headers
        big = c.post(
            "/admin/console/login",
            content=b"key=" + b"a" * 10000,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
        empty = c.post(
            "/admin/console/login", content=b"", headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert empty.status_code == 401


def test_a_session_works_on_every_replica_and_ends_with_the_admin_key(bg, eng, tmp_path):
    """Two gateways that share nothing but the admin key: a cookie from one works on the other."""
    keys = tenant_keys()
    a_doc = config(eng, tmp_path / "a", keys)
    b_doc = config(eng, tmp_path / "b", keys)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start(bg, a_doc, tmp_path / "a" / "omnigate.yaml")
    b = start(bg, b_doc, tmp_path / "b" / "omnigate.yaml")
    try:
        with _client(a) as ca:
            _sign_in(ca)
            value = ca.cookies.get(session.COOKIE)
        with _client(b) as cb:
            cb.cookies.set(session.COOKIE, value, path="/admin")
            assert cb.get("/admin/console/overview").status_code == 200
            assert cb.get("/admin/tenants").status_code == 200
            # rotate the admin key on b with a hot reload: every session signed with the old key ends there
            new_key = secrets.token_hex(32)
            (tmp_path / "b" / "omnigate.yaml").write_text(
                yaml.safe_dump({**b_doc, "admin": {"api_key": new_key, "console": {"enabled": True}}})
            )
            reload = cb.post("/admin/config/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert reload.status_code == 200, reload.text
            assert cb.get("/admin/tenants").status_code == 401
            assert cb.get("/admin/console/overview").status_code == 303
    finally:
        a.stop()
        b.stop()


def test_sign_out_clears_the_cookie_and_sign_in_is_recorded(gw):
    server = gw[0]
    with _client(server) as c:
        _sign_in(c)
        token = _csrf(c)
        out = c.post("/admin/console/logout", headers={"x-csrf-token": token})
        assert out.status_code == 200 and "max-age=0" in out.headers["set-cookie"].lower()
        assert c.get("/admin/console/overview").status_code == 303
    records = httpx.get(
        server.url + "/admin/audit/records", params={"kind": "admin_change"}, headers=ADMIN
    ).json()
    assert "console_signed_in" in [r["action"] for r in records["records"]]


_FILLED = {"page": "overview", "name": "console.js"}


def _admin_routes(server) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under /admin, path parameters filled in."""

    def flat(routes):  # an included router keeps its routes on original_router
        for r in routes:
            inner = getattr(r, "original_router", None)
            yield from flat(inner.routes) if inner is not None else (r,)

    out = []
    for route in flat(server.app.routes):
        path = getattr(route, "path", "")
        if not path.startswith("/admin"):
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, re.sub(r"\{([^}]+)\}", lambda m: _FILLED.get(m.group(1), "1"), path)))
    return out


def test_every_admin_route_needs_a_credential(bg, eng, tmp_path):
    """Walks the app's own route table, so a route added later without the admin dependency fails here."""
    doc = config(eng, tmp_path, tenant_keys())
    # Every refused call counts against the address; the walk is longer than the default limit of 20.
    doc["auth"] = {"failures": {"max_failures": 10_000, "store": "memory"}}
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        _walk_admin_routes(server)
    finally:
        server.stop()


def _walk_admin_routes(server) -> None:
    routes = _admin_routes(server)
    assert len(routes) > 25 and ("GET", "/admin/audit/records") in routes
    open_by_design = {
        ("GET", "/admin/console/login"),
        ("POST", "/admin/console/login"),
        ("GET", "/admin/console/static/console.js"),
    }
    with _client(server) as c:
        for method, path in routes:
            r = c.request(method, path)
            if (method, path) in open_by_design:
                assert r.status_code in (200, 401), (method, path, r.status_code)
            elif path.startswith("/admin/console"):
                # pages send the browser to the sign-in form; sign-out without a session is refused
                assert r.status_code in (303, 401), (method, path, r.status_code)
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"


def test_without_an_admin_key_every_admin_route_is_404(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys(), console=False)
    doc["admin"] = {}
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        with _client(server) as c:
            for method, path in _admin_routes(server):
                r = c.request(method, path, headers=ADMIN)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path)
    finally:
        server.stop()


def test_a_trickled_sign_in_form_is_cut_off_with_408(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys())
    doc["server"] = {"body_timeout_s": 1.0}
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=15) as s:
            s.sendall(
                b"POST /admin/console/login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 200\r\n\r\nkey=a"
            )
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"set-cookie" not in reply.lower()
    finally:
        server.stop()


def test_a_reload_that_turns_the_console_off_ends_its_sessions_at_once(gw):
    server, doc, path = gw
    with _client(server) as c:
        _sign_in(c)
        assert c.get("/admin/engines").status_code == 200
        path.write_text(yaml.safe_dump({**doc, "admin": {**doc["admin"], "console": {"enabled": False}}}))
        assert httpx.post(server.url + "/admin/config/reload", headers=ADMIN, timeout=10).status_code == 200
        assert c.get("/admin/console/overview").status_code == 404
        assert c.get("/admin/engines").status_code == 401  # the cookie is no credential any more
        assert httpx.get(server.url + "/admin/engines", headers=ADMIN, timeout=10).status_code == 200


def test_failed_sign_ins_share_the_per_address_limit(bg, eng, tmp_path):
    doc = config(eng, tmp_path, tenant_keys())
    doc["auth"] = {"failures": {"max_failures": 3, "window_s": 60, "store": "memory"}}
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        with _client(server) as c:
            assert [_sign_in(c, "wrong-" + str(i)).status_code for i in range(3)] == [401, 401, 401]
            throttled = _sign_in(c, "wrong-again")
            assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
            assert throttled.json()["error"]["code"] == "too_many_authentication_failures"
    finally:
        server.stop()
