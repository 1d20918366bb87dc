"""The lease protocol in Redis sorted sets (core/leases.py): the calls' KEYS and ARGV, and the scripts
against the real Redis at 127.0.0.1:6379 as the engines' caps use them (a hard limit, no tenant key)."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from core.leases import (
    ACQUIRE_LUA,
    COUNT_LUA,
    GRANTED,
    REFUSED_LIMIT,
    REFUSED_QUOTA,
    RELEASE_LUA,
    RENEW_LUA,
    acquire_call,
    lease_ids,
    release_call,
    renew_call,
)

pytestmark = pytest.mark.timeout(30)


def test_tenant_keys_are_listed_once_and_indexed_from_one_after_the_main_key():
    keys, args = acquire_call(
        "m", 500, [("a", 4, 2, "t1"), ("b", 4, None, None), ("c", 4, 1, "t2"), ("d", 4, 2, "t1")]
    )
    assert keys == ["m", "t1", "t2"]
    assert args == [500, "a", 4, 2, 2, "b", 4, 0, 0, "c", 4, 1, 3, "d", 4, 2, 2]
    assert release_call("m", [("a", "t2"), ("b", None), ("c", "t2")]) == (
        ["m", "t2"],
        ["a", 2, "b", 0, "c", 2],
    )
    assert renew_call("m", 500, [("a", None), ("b", "t")]) == (["m", "t"], [500, "a", 0, "b", 2])
    assert lease_ids([b"r:1", "r:2"]) == ["r:1", "r:2"]


@pytest.fixture
async def client():
    c = aioredis.from_url("redis://127.0.0.1:6379/0")
    try:
        await c.ping()
    except Exception as exc:  # the suite needs the real service
        pytest.fail(f"Redis is not reachable: {exc!r}")
    yield c
    await c.aclose()


async def test_a_cap_is_a_hard_limit_and_renew_names_the_leases_gone(client):
    key = f"{{omnigate-test:{uuid.uuid4().hex}}}:engine:e"
    tenant = key + ":tenant"
    acquire, release = client.register_script(ACQUIRE_LUA), client.register_script(RELEASE_LUA)
    renew, count = client.register_script(RENEW_LUA), client.register_script(COUNT_LUA)
    try:
        got = []
        for i in range(3):
            keys, args = acquire_call(key, 5000, [(f"r:{i}", 2, None, None)])
            got.append(await acquire(keys=keys, args=args))
        assert [r[0][0] for r in got] == [GRANTED, GRANTED, REFUSED_LIMIT]
        assert [r[0][1] for r in got] == [0, 1, 2]
        assert int(await count(keys=[key])) == 2
        keys, args = release_call(key, [("r:0", None), ("r:9", None)])
        assert int(await release(keys=keys, args=args)) == 1
        keys, args = renew_call(key, 5000, [("r:1", None), ("r:0", None)])
        assert lease_ids(await renew(keys=keys, args=args)) == ["r:0"]
        assert 0 < await client.pttl(key) <= 5000
        # a tenant at its quota is refused before the hard limit is looked at
        keys, args = acquire_call(key, 5000, [("r:3", 9, 1, tenant), ("r:4", 9, 1, tenant)])
        assert [tuple(r) for r in await acquire(keys=keys, args=args)] == [
            (GRANTED, 1, 0),
            (REFUSED_QUOTA, 2, 1),
        ]
    finally:
        await client.delete(key, tenant)
