"""Realtime session places (gateway/realtime/places.py) through the real Redis at 127.0.0.1:6379: one key's
cap shared by two replicas' stores, taken atomically, given back, renewed while the session lives, expired
when its replica stops renewing, and failing open to a share of the cap when Redis goes away."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry

from gateway.realtime.places import LocalPlaces, Place, SharedPlaces
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RedisSettings, TrafficSettings
from observability.metrics import Metrics
from tests.harness import eventually
from tests.tcpproxy import TCPProxy

pytestmark = pytest.mark.timeout(60)

REDIS_URL = "redis://127.0.0.1:6379/0"
WHO = "key_abc"


@pytest.fixture
async def redis_client():
    client = aioredis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:  # the suite needs the real service
        pytest.fail(f"Redis at {REDIS_URL} is not reachable: {exc!r}")
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis_client):
    p = f"omnigate-test:{uuid.uuid4().hex}"
    yield p
    keys = [k async for k in redis_client.scan_iter(match=f"{{{p}}}:*")]
    if keys:
        await redis_client.delete(*keys)


@pytest.fixture
async def stores():
    made: list[tuple[SharedPlaces, SharedRedis]] = []

    async def make(
        prefix: str, url: str = REDIS_URL, *, probe_s: float = 1.0, timeout_s: float = 0.25, **traffic
    ) -> SharedPlaces:
        redis = SharedRedis(RedisSettings(url=url, probe_s=probe_s, timeout_s=timeout_s))
        store = SharedPlaces(
            TrafficSettings(key_prefix=prefix, **traffic), redis, Metrics(CollectorRegistry())
        )
        await store.start()
        made.append((store, redis))
        return store

    yield make
    for store, redis in made:
        await store.aclose()
        await redis.aclose()


async def _live(client, store: SharedPlaces, who: str = WHO) -> int:
    """The places of ``who`` whose lease has not expired (by the Redis server's clock, as the scripts count)."""
    seconds, micros = await client.time()
    return int(await client.zcount(store.key(who), seconds * 1000 + micros // 1000, "+inf"))


async def test_two_replicas_share_one_keys_cap_and_the_last_place_goes_once(redis_client, prefix, stores):
    a, b = await stores(prefix), await stores(prefix)
    # Eight handshakes at once, four on each replica, for a cap of 2: exactly two places are taken.
    got = await asyncio.gather(*(s.take(WHO, 2) for s in (a, b) * 4))
    taken = [p for p in got if p is not None]
    assert len(taken) == 2
    assert await _live(redis_client, a) == 2
    other = await a.take("another_key", 2)  # each key has its own places
    assert other is not None
    taken[0].release()
    taken[0].release()  # a second release gives nothing back twice
    assert await eventually(lambda: _count_is(redis_client, a, 1), 5)
    again = await b.take(WHO, 2)
    assert again is not None
    assert await a.take(WHO, 2) is None
    for p in (taken[1], again, other):
        p.release()
    assert await eventually(lambda: _count_is(redis_client, a, 0), 5)
    assert a.held == {} and b.held == {}


async def _count_is(client, store: SharedPlaces, n: int) -> bool:
    return await _live(client, store) == n


async def test_a_replica_that_stops_renewing_loses_its_places_and_a_live_one_keeps_its_own(
    redis_client, prefix, stores
):
    a = await stores(prefix, lease_ttl_s=1.0, heartbeat_s=0.1)
    b = await stores(prefix, lease_ttl_s=1.0, heartbeat_s=0.1)
    held_by_a = await a.take(WHO, 3)
    kept = await b.take(WHO, 3)
    assert held_by_a is not None and kept is not None
    a._loop_task.cancel()  # as a killed or frozen process: nothing renews a's place any more
    assert await b.take(WHO, 2) is None
    await asyncio.sleep(2.0)  # two TTLs: a's place is gone, b's was renewed
    assert await _live(redis_client, b) == 1
    more = await b.take(WHO, 2)
    assert more is not None
    assert await b.take(WHO, 2) is None
    for p in (kept, more):
        p.release()
    a.held.clear()
    a.owners.clear()


async def test_a_place_whose_session_ended_without_giving_it_back_is_given_back(redis_client, prefix, stores):
    store = await stores(prefix, lease_ttl_s=5.0, heartbeat_s=0.1)

    async def session() -> Place | None:
        return await store.take(WHO, 1)  # ends holding its place, never releasing it

    with structlog.testing.capture_logs() as logs:
        assert await asyncio.create_task(session()) is not None
        assert await eventually(lambda: _count_is(redis_client, store, 0), 3)
    assert any(e["event"] == "realtime_place_leaked" for e in logs)
    assert store.held == {}


async def test_a_handshake_cancelled_while_taking_leaves_no_place(redis_client, prefix, stores):
    store = await stores(prefix)
    for turns in range(6):  # cancelled before, during and after the script ran
        task = asyncio.create_task(store.take(WHO, 1))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            place = await task
        except asyncio.CancelledError:
            continue
        assert place is not None
        place.release()
    await asyncio.gather(*store._tasks)
    assert await eventually(lambda: _count_is(redis_client, store, 0), 5)
    assert store.held == {}
    last = await store.take(WHO, 1)
    assert last is not None
    last.release()


async def test_unreachable_redis_fails_open_to_a_share_of_the_cap(stores):
    with structlog.testing.capture_logs() as logs:
        store = await stores("omnigate-test:down", "redis://127.0.0.1:1/0", fail_open_share=0.5)
        assert store.up is False
        places = [await store.take(WHO, 4) for _ in range(3)]
    assert [p is not None for p in places] == [True, True, False]  # floor(4 * 0.5)
    assert await store.take("another_key", 1) is not None  # never below one
    assert any(e["event"] == "realtime_places_store_unreachable" for e in logs)


async def test_an_outage_counts_the_places_still_held_in_redis_and_recovers(redis_client, prefix, stores):
    proxy = await TCPProxy("127.0.0.1", 6379).start()
    try:
        with structlog.testing.capture_logs() as logs:
            store = await stores(prefix, proxy.url, probe_s=0.1, timeout_s=0.2)
            before = await store.take(WHO, 2)
            assert before is not None and await _live(redis_client, store) == 1
            await proxy.stop()  # Redis vanishes
            during = await store.take(WHO, 2)
            assert during is not None and store.up is False
            assert store.fallback.open == {WHO: 1}
            # alone, the replica still counts the place it holds in Redis: the cap is reached
            assert await store.take(WHO, 2) is None
            during.release()
            assert store.fallback.open == {}
            before.release()  # its give-back fails; the lease expires on its own
            await proxy.start()
            assert await eventually(lambda: store.up, 5)
            after = await store.take(WHO, 2)
            assert after is not None and await _live(redis_client, store) >= 1
            after.release()
        events = [e["event"] for e in logs]
        assert events.count("realtime_places_store_unreachable") == 1
        assert "realtime_places_store_recovered" in events
    finally:
        await proxy.stop()


async def test_local_places_count_one_process():
    places = LocalPlaces()
    first, second = await places.take(WHO, 2), await places.take(WHO, 2)
    assert first is not None and second is not None
    assert await places.take(WHO, 2) is None
    first.release()
    first.release()
    assert places.open == {WHO: 1}
    third = await places.take(WHO, 2)
    assert third is not None
    second.release()
    third.release()
    assert places.open == {}
