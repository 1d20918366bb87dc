"""Two real ``omnigate serve`` processes on one PostgreSQL directory: a key created or revoked through one
replica is honoured or refused by the other within the documented bound (``refresh_s + timeout_s``)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
import yaml

from tests.harness import ServeProcess, wait_until
from tests.stores import fresh_pg_database, redis_prefix
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(150)

REFRESH_S, TIMEOUT_S = 0.5, 1.0
BOUND_S = REFRESH_S + TIMEOUT_S  # the README's bound for this config
ADMIN_KEY = secrets.token_hex(32)
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "text", "messages": [{"role": "user", "content": "hi"}]}


class Gateway(ServeProcess):
    def chat(self, key: str) -> int:
        return httpx.post(
            self.url + "/v1/chat/completions",
            json=BODY,
            timeout=10,
            headers={"authorization": f"Bearer {key}"},
        ).status_code


@pytest.fixture(scope="module")
def upstream(bg):
    up = ScriptedUpstream(Script(flavour="vllm"))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture
def pair(tmp_path, upstream):
    with fresh_pg_database() as dsn:
        config = {
            "engines": [
                {
                    "name": "text-vllm",
                    "kind": "vllm",
                    "base_url": upstream.base_url,
                    "model": "scripted",
                    "serves": ["text"],
                }
            ],
            "admin": {"api_key": ADMIN_KEY},
            "auth": {
                "replicas": 2,
                "directory": {
                    "backend": "postgres",
                    "postgres_dsn": dsn,
                    "refresh_s": REFRESH_S,
                    "timeout_s": TIMEOUT_S,
                },
            },
            "rate_limits": {"key_prefix": redis_prefix()},
            "audit": {"store": "postgres", "postgres_dsn": dsn},
            "server": {"drain_delay_s": 0, "graceful_shutdown_s": 2},
            "logging": {"level": "info"},
        }
        path = tmp_path / "omnigate.yaml"
        path.write_text(yaml.safe_dump(config))
        made = [Gateway(path, tmp_path / f"gateway-{i}.log") for i in range(2)]
        try:
            assert wait_until(lambda: all(g.ready() for g in made), timeout=90, interval=0.2)
            yield made
        finally:
            for g in made:
                g.stop()


def _within_bound(predicate) -> float:
    """Seconds until ``predicate`` held; fails if that took longer than the bound (plus a request's slack)."""
    start = time.monotonic()
    assert wait_until(predicate, timeout=BOUND_S + 3.0, interval=0.05), "not within the documented bound"
    return time.monotonic() - start


def test_a_key_made_on_one_replica_is_honoured_and_its_revocation_refused_on_the_other(pair):
    a, b = pair
    # Both enforce keys from the start, with no tenant anywhere (a fresh, empty directory).
    assert a.chat("anything") == 401 and b.chat("anything") == 401
    assert (
        httpx.post(a.url + "/admin/tenants", headers=ADMIN, json={"name": "newco"}, timeout=10).status_code
        == 201
    )
    made = httpx.post(a.url + "/admin/keys", headers=ADMIN, json={"tenant": "newco"}, timeout=10).json()
    key = made["key"]
    assert a.chat(key) == 200
    _within_bound(lambda: b.chat(key) == 200)

    revoked = httpx.delete(b.url + f"/admin/keys/{made['id']}", headers=ADMIN, timeout=10)
    assert revoked.status_code == 200 and b.chat(key) == 401
    _within_bound(lambda: a.chat(key) == 401)

    # A tenant disabled through one replica stops the keys it has on the other too.
    again = httpx.post(b.url + "/admin/keys", headers=ADMIN, json={"tenant": "newco"}, timeout=10).json()[
        "key"
    ]
    _within_bound(lambda: a.chat(again) == 200)
    off = httpx.put(
        a.url + "/admin/tenants/newco", headers=ADMIN, json={"name": "newco", "enabled": False}, timeout=10
    )
    assert off.status_code == 200
    _within_bound(lambda: b.chat(again) == 401)
    ready = httpx.get(b.url + "/readyz", headers=ADMIN, timeout=5).json()["auth"]
    assert ready["directory"]["shared"] and ready["directory"]["admin_writes"] == "allowed"
