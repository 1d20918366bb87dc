"""A blocked address is refused on every attempt, right key or wrong, until its block ends.

The failure limit used to refuse only the wrong guesses of an address over it: a brute force kept
trying, and the guess that was right was served. Now the block is judged before the credential is
looked at (tenant keys, the admin key, the console's sign-in), so the answer, a 429 with
``Retry-After``, is the same whether the key was right and says nothing about it. Other addresses
are not affected. Addresses come from ``X-Forwarded-For``, which uvicorn takes from the loopback
proxy the tests connect as.
"""

from __future__ import annotations

import secrets

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from tests.conftest import TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.stores import redis_prefix

pytestmark = pytest.mark.timeout(90)

ADMIN_KEY = secrets.token_hex(32)
ATTACKER = "203.0.113.7"
OTHER = "198.51.100.9"
LIMIT = 3
WINDOW_S = 2


@pytest.fixture(scope="module")
def server(bg, upstreams):
    key = mint_key()
    settings = gateway_settings(
        upstreams,
        tenants=[{"name": "t"}],
        api_keys=[{"id": key.id, "tenant": "t", "sha256": key.sha256}],
        admin={"api_key": ADMIN_KEY, "console": {"enabled": True}},
        auth={"failures": {"max_failures": LIMIT, "window_s": WINDOW_S, "store": "memory"}},
        rate_limits={"key_prefix": redis_prefix()},
    )
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    s.key = key.key
    yield s
    s.stop()


def _chat(server, key: str, address: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}", "x-forwarded-for": address},
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )


def _models(server, key: str, address: str) -> httpx.Response:
    return httpx.get(
        server.url + "/v1/models",
        headers={"authorization": f"Bearer {key}", "x-forwarded-for": address},
        timeout=10,
    )


def _admin(server, key: str, address: str) -> httpx.Response:
    return httpx.get(
        server.url + "/admin/tenants",
        headers={"authorization": f"Bearer {key}", "x-forwarded-for": address},
        timeout=10,
    )


def _sign_in(server, key: str, address: str) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/console/login",
        data={"key": key},
        headers={"x-forwarded-for": address},
        timeout=10,
    )


def _throttled(resp: httpx.Response) -> tuple[int, str, str, str | None]:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert 1 <= float(resp.headers["retry-after"]) <= WINDOW_S + 1
    return resp.status_code, err["type"], err["code"], err["param"]


def _block(server, address: str) -> httpx.Response:
    """Fail until ``address`` is over the limit; the first throttled answer."""
    assert [_chat(server, "sk-wrong-" + secrets.token_hex(8), address).status_code for _ in range(LIMIT)] == [
        401
    ] * LIMIT
    wrong = _chat(server, "sk-wrong-" + secrets.token_hex(8), address)
    assert wrong.status_code == 429
    return wrong


def _unblocked(server, address: str) -> None:
    # The block ends with the failure window (WINDOW_S); polled, not timed.
    assert wait_until(lambda: _chat(server, server.key, address).status_code == 200, timeout=WINDOW_S + 8)


def test_a_right_tenant_key_from_a_blocked_address_is_refused_like_a_wrong_one(server):
    wrong = _block(server, ATTACKER)
    right = _chat(server, server.key, ATTACKER)
    assert right.status_code == 429
    # Nothing tells the right key from a wrong one: same status, type, code and param.
    assert (
        _throttled(right)
        == _throttled(wrong)
        == (429, "rate_limit_error", "too_many_authentication_failures", None)
    )
    assert _models(server, server.key, ATTACKER).status_code == 429
    # Another address is not affected, and its own key works.
    assert _chat(server, server.key, OTHER).status_code == 200
    assert _chat(server, "sk-wrong", OTHER).status_code == 401
    _unblocked(server, ATTACKER)


def test_the_admin_key_and_the_console_sign_in_are_refused_from_a_blocked_address(server):
    _block(server, ATTACKER)
    admin = _admin(server, ADMIN_KEY, ATTACKER)
    assert admin.status_code == 429 and _throttled(admin)[2] == "too_many_authentication_failures"
    console = _sign_in(server, ADMIN_KEY, ATTACKER)
    assert console.status_code == 429 and "set-cookie" not in console.headers
    assert _admin(server, ADMIN_KEY, OTHER).status_code == 200
    _unblocked(server, ATTACKER)
    assert _admin(server, ADMIN_KEY, ATTACKER).status_code == 200


def test_wrong_admin_keys_block_the_right_one_too(server):
    assert [_admin(server, secrets.token_hex(32), ATTACKER).status_code for _ in range(LIMIT)] == [
        401
    ] * LIMIT
    assert _admin(server, secrets.token_hex(32), ATTACKER).status_code == 429
    assert _admin(server, ADMIN_KEY, ATTACKER).status_code == 429
    assert _chat(server, server.key, ATTACKER).status_code == 429  # one block per address, every door
    _unblocked(server, ATTACKER)
