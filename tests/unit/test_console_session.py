"""The console's session cookie and CSRF token, without a server: what is refused and what is bound to what."""

from __future__ import annotations

import json
import time

import pytest
from itsdangerous import URLSafeSerializer
from itsdangerous.encoding import base64_decode, base64_encode
from starlette.requests import Request

from core.errors import PermissionDenied
from gateway.api import console_session as session

pytestmark = pytest.mark.timeout(30)

KEY = "an-admin-key-of-this-gateway"


def _resign_payload(token: str, **changes: object) -> str:
    """The token's payload with ``changes``, carrying the original signature."""
    payload, signature = token.rsplit(".", 1)
    claims = json.loads(base64_decode(payload))
    return base64_encode(json.dumps({**claims, **changes})).decode() + "." + signature


def test_a_cookie_reads_back_until_it_expires():
    now = 1_800_000_000.0
    token = session.issue(KEY, 600, now=now)
    got = session.read(token, KEY, now=now + 599)
    assert got is not None and got.expires == int(now + 600) and len(got.nonce) >= 24
    assert session.read(token, KEY, now=now + 600) is None  # expired at its expiry
    assert session.read(session.issue(KEY, 600, now=time.time() - 3600), KEY) is None
    # two sign-ins are two sessions
    assert (
        session.read(session.issue(KEY, 600), KEY).nonce != session.read(session.issue(KEY, 600), KEY).nonce
    )


def test_a_tampered_cookie_is_refused():
    token = session.issue(KEY, 600)
    good = session.read(token, KEY)
    assert good is not None
    assert session.read(_resign_payload(token, e=good.expires + 10**6), KEY) is None  # a longer life
    assert session.read(_resign_payload(token, n="someone-elses-nonce"), KEY) is None
    payload, signature = token.rsplit(".", 1)
    # every character of the signature but the last, whose two low bits base64 decoding ignores
    for i in range(len(signature) - 1):
        changed = "A" if signature[i] != "A" else "B"
        assert session.read(f"{payload}.{signature[:i]}{changed}{signature[i + 1 :]}", KEY) is None
    for value in (None, "", "garbage", "a.b", "." * 300, token + "x" * 200):
        assert session.read(value, KEY) is None


def test_a_cookie_signed_with_another_key_or_shape_is_refused():
    assert session.read(session.issue("another-gateways-admin-key", 600), KEY) is None
    # validly signed with this key and salt, but not the shape issued here
    signer = session._serializer(KEY)
    assert isinstance(signer, URLSafeSerializer)
    far = int(time.time()) + 600
    for claims in (
        [far],
        {"n": "x"},
        {"e": far},
        {"n": 1, "e": far},
        {"n": "x", "e": "9" * 12},
        {"n": "x", "e": True},
    ):
        assert session.read(signer.dumps(claims), KEY) is None, claims
    assert session.read(signer.dumps({"n": "x", "e": far}), KEY) == session.Session("x", far)


def test_the_csrf_token_is_bound_to_the_session_and_the_key():
    one = session.read(session.issue(KEY, 600), KEY)
    two = session.read(session.issue(KEY, 600), KEY)
    assert one is not None and two is not None
    token = session.csrf_token(one, KEY)
    assert token == session.csrf_token(one, KEY)
    assert token != session.csrf_token(two, KEY)
    assert token != session.csrf_token(one, "another-gateways-admin-key")


def _request(method: str, cookie: str, csrf: str | None) -> Request:
    headers = [(b"host", b"gw.example"), (b"cookie", f"{session.COOKIE}={cookie}".encode())]
    if csrf is not None:
        headers.append((session.CSRF_HEADER.encode(), csrf.encode()))
    return Request(
        {"type": "http", "method": method, "path": "/admin/x", "headers": headers, "query_string": b""}
    )


def test_a_change_needs_the_sessions_csrf_token():
    cookie = session.issue(KEY, 600)
    current = session.read(cookie, KEY)
    assert current is not None
    token = session.csrf_token(current, KEY)
    assert session.from_request(_request("GET", cookie, None), KEY) == current
    assert session.from_request(_request("POST", cookie, token), KEY) == current
    other = session.csrf_token(session.read(session.issue(KEY, 600), KEY), KEY)
    for sent in (None, "", "A" * 43, other, token + "A", "not base64 !"):
        with pytest.raises(PermissionDenied):
            session.from_request(_request("POST", cookie, sent), KEY)
    assert session.from_request(_request("POST", "forged", token), KEY) is None
