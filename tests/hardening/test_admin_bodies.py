"""Every request body has the body deadline, not only the chat route's.

The chat route bounded its own body read by ``server.body_timeout_s``; the admin routes (and any other
route that reads a body) read theirs with no deadline, so a client that stalled or trickled an admin
POST body held a connection and a task for as long as it liked. The deadline is now the app's
(gateway/middleware.py), so no route can forget it: a body not complete in time is answered 408 in
OpenAI's error shape and the connection is closed. The attacks run against a served gateway over
raw sockets.
"""

from __future__ import annotations

import secrets
import socket
import time

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from tests.conftest import gateway_settings
from tests.harness import GatewayServer, wait_until

pytestmark = pytest.mark.timeout(90)

KEY = secrets.token_hex(32)
TENANT = mint_key()
BODY_TIMEOUT_S = 1.0
# A hang must fail the test fast, not hold it: the most any read below waits.
GUARD_S = BODY_TIMEOUT_S + 20


@pytest.fixture(scope="module")
def gw(bg, upstreams):
    settings = gateway_settings(
        upstreams,
        admin={"api_key": KEY},
        server={"body_timeout_s": BODY_TIMEOUT_S},
        tenants=[{"name": "acme"}],
        api_keys=[{"id": TENANT.id, "tenant": "acme", "sha256": TENANT.sha256}],
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()


def _head(method: str, path: str, length: int) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _read_until_closed(sock: socket.socket) -> tuple[bool, bytes]:
    """What the server sent until it closed the connection (False: the guard ran out first)."""
    sock.settimeout(GUARD_S)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got
    return True, got


def _assert_408(got: bytes) -> None:
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), got[:200]
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "request_timeout"


def _quiet(gw: GatewayServer) -> bool:
    """No request task left in the server (only its own connections' bookkeeping)."""
    return gw.bg.call(lambda: not gw.server.server_state.tasks)


ROUTES = [
    ("POST", "/admin/routing/pin"),
    ("POST", "/admin/tenants"),
    ("PUT", "/admin/tenants/someone"),
    ("POST", "/admin/keys"),
]


@pytest.mark.parametrize("method, path", ROUTES, ids=[p for _, p in ROUTES])
def test_a_stalled_admin_body_is_answered_408_and_closed_within_the_deadline(gw, method, path):
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(_head(method, path, 100) + b'{"model"')  # 8 of the 100 bytes, then nothing
        closed, got = _read_until_closed(sock)
        assert closed, "the connection is still open"
        _assert_408(got)
        assert wait_until(lambda: _quiet(gw), timeout=10, interval=0.05)  # no task is left holding it


def test_a_trickled_admin_body_does_not_move_the_deadline(gw):
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(_head("POST", "/admin/routing/pin", 10_000))
        got = b""
        deadline = time.monotonic() + GUARD_S
        closed = False
        while time.monotonic() < deadline:
            try:
                sock.sendall(b" ")  # a byte now and then: whitespace a JSON body may hold
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.2)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
        assert closed, "the connection is still open"
        if got:  # the answer may be lost to a reset when the client was still writing
            _assert_408(got)
    assert wait_until(lambda: _quiet(gw), timeout=10, interval=0.05)


def test_many_stalled_admin_bodies_hold_nothing(gw):
    socks = [socket.create_connection(("127.0.0.1", gw.port), timeout=5) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(_head("POST", "/admin/routing/pin", 100) + b"{")
        for s in socks:
            closed, got = _read_until_closed(s)
            assert closed
            _assert_408(got)
    finally:
        for s in socks:
            s.close()
    assert wait_until(lambda: _quiet(gw), timeout=10, interval=0.05)
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200


def test_a_body_in_time_is_served_and_a_slow_route_after_it_is_not_cut(gw):
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=gw.url, timeout=10, headers=headers) as c:
        resp = c.post("/admin/routing/pin", json={"model": "nope", "variant": "int4"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        # The deadline is the body's: the same connection carries a second request, and a request
        # without a body is never timed by it.
        time.sleep(BODY_TIMEOUT_S * 1.5)
        assert c.get("/admin/engines").status_code == 200
        resp = c.post("/admin/routing/pin", json={"model": "nope", "variant": "int4"})
        assert resp.status_code == 404


def test_the_chat_routes_own_deadline_still_answers(gw):
    # The chat route reads its body under the same deadline and records the request it refuses.
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + TENANT.key.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        sock.sendall(head)
        closed, got = _read_until_closed(sock)
        assert closed, "the connection is still open"  # a 408 closes it (RFC 9110, 15.5.9)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert wait_until(lambda: _quiet(gw), timeout=10, interval=0.05)
