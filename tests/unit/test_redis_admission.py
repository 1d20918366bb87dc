"""Admission slots shared through the real Redis at 127.0.0.1:6379: Lua acquire and release, lease expiry,
heartbeats, and failing open (and back) when Redis goes away. Each test has its own key prefix."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid

import pytest
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry

from core.context import RequestContext
from core.errors import Overloaded, RateLimited
from gateway.admission import AdmissionGate
from gateway.admission_redis import RedisSlots
from gateway.admission_slots import Limits, LocalSlots, Ticket
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RedisSettings, TrafficSettings
from observability.metrics import Metrics
from tests.harness import eventually
from tests.tcpproxy import TCPProxy

pytestmark = pytest.mark.timeout(60)

REDIS_URL = "redis://127.0.0.1:6379/0"


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
async def gates():
    made: list[tuple[AdmissionGate, SharedRedis]] = []

    async def make(
        prefix: str,
        url: str = REDIS_URL,
        *,
        redis_probe_s: float = 1.0,
        redis_timeout_s: float = 0.25,
        **traffic,
    ) -> AdmissionGate:
        cfg = TrafficSettings(key_prefix=prefix, **traffic)
        redis = SharedRedis(RedisSettings(url=url, probe_s=redis_probe_s, timeout_s=redis_timeout_s))
        gate = AdmissionGate(cfg, Metrics(CollectorRegistry()), redis=redis)
        await gate.start()
        made.append((gate, redis))
        return gate

    yield make
    for g, redis in made:
        await g.aclose()
        await redis.aclose()


def _ctx(**kw) -> RequestContext:
    return RequestContext.new(uuid.uuid4().hex, **kw)


async def _live(client, prefix: str, suffix: str = "slots") -> int:
    return await client.zcard(f"{{{prefix}}}:{suffix}")


def _sample(gate: AdmissionGate, name: str, labels: dict | None = None) -> float | None:
    return gate.metrics.registry.get_sample_value(name, labels or {})


async def test_two_replicas_share_one_limit_and_give_slots_back(redis_client, prefix, gates):
    a = await gates(prefix, soft_limit=2, hard_limit=4)
    b = await gates(prefix, soft_limit=2, hard_limit=4)
    assert a.store.up and b.store.up and a.replica_id != b.replica_id
    tickets, above = [], []
    for gate in (a, b, a, b):
        ctx = _ctx()
        tickets.append(await gate.admit(ctx))
        above.append(ctx.load.above_soft_limit)
        assert ctx.load.store == "redis"
    assert above == [False, False, True, True]  # the count is the gateway's, not each replica's
    assert await _live(redis_client, prefix) == 4
    for gate in (a, b):
        with pytest.raises(Overloaded) as info:
            await gate.admit(_ctx())
        assert info.value.retry_after == 1.0
    assert await a.observe() is True  # both read the shared count
    assert await b.store.in_flight() == 4
    for t in tickets:
        t.release()
        t.release()
    assert await eventually(lambda: _zero(redis_client, prefix), 5)
    assert a.store.held == {} and b.store.held == {}
    assert _sample(a, "omnigate_admission_duration_seconds_count", {"store": "redis"}) == 3


async def _zero(client, prefix: str) -> bool:
    return await _live(client, prefix) == 0


async def test_tenant_quota_is_shared_across_replicas(redis_client, prefix, gates):
    a = await gates(prefix)
    b = await gates(prefix)
    t1 = await a.admit(_ctx(tenant="acme", tenant_max_concurrency=2))
    t2 = await b.admit(_ctx(tenant="acme", tenant_max_concurrency=2))
    with pytest.raises(RateLimited):
        await a.admit(_ctx(tenant="acme", tenant_max_concurrency=2))
    t3 = await a.admit(_ctx(tenant="globex", tenant_max_concurrency=2))
    assert await _live(redis_client, prefix, "tenant:acme") == 2
    for t in (t1, t2, t3):
        t.release()
    assert await eventually(lambda: _zero(redis_client, prefix), 5)
    assert await _live(redis_client, prefix, "tenant:acme") == 0


async def test_a_dead_replicas_slots_expire_and_a_live_ones_are_renewed(redis_client, prefix, gates):
    # a holds two slots and then stops renewing them (as a killed process would); b keeps its own alive.
    a = await gates(prefix, hard_limit=3, soft_limit=1, lease_ttl_s=1.0, heartbeat_s=0.1)
    b = await gates(prefix, hard_limit=3, soft_limit=1, lease_ttl_s=1.0, heartbeat_s=0.1)
    [await a.admit(_ctx()) for _ in range(2)]
    kept = await b.admit(_ctx())
    a.store._loop_task.cancel()
    with pytest.raises(Overloaded):
        await b.admit(_ctx())
    await asyncio.sleep(2.0)  # two TTLs: a's leases are gone, b's were renewed
    assert await _live(redis_client, prefix) == 1
    more = [await b.admit(_ctx()) for _ in range(2)]
    with pytest.raises(Overloaded):
        await b.admit(_ctx())
    assert (_sample(b, "omnigate_admission_lease_renewals_total", {"result": "renewed"}) or 0) >= 5
    for t in (kept, *more):
        t.release()
    a.store.held.clear()


async def test_a_lease_lost_in_redis_is_reported_not_resurrected(redis_client, prefix, gates):
    gate = await gates(prefix, lease_ttl_s=2, heartbeat_s=0.1)
    with structlog.testing.capture_logs() as logs:
        ticket = await gate.admit(_ctx())
        await redis_client.delete(f"{{{prefix}}}:slots")  # e.g. Redis restarted without persistence
        assert await eventually(
            lambda: _sample(gate, "omnigate_admission_lease_renewals_total", {"result": "lost"}) == 1, 3
        )
    assert any(e["event"] == "admission_lease_lost" for e in logs)
    assert gate.store.held == {}
    assert await _live(redis_client, prefix) == 0
    ticket.release()


async def test_lua_and_local_decisions_agree(redis_client, prefix, gates):
    gate = await gates(prefix)
    redis_store: RedisSlots = gate.store
    local = LocalSlots()
    rng = random.Random(7)
    held: list[tuple[str, str | None]] = []
    limits = Limits(soft=3, hard=6, tenant_quota=2)
    for i in range(200):
        if held and rng.random() < 0.45:
            lease, tenant = held.pop(rng.randrange(len(held)))
            redis_store.release(Ticket(lease, tenant, redis_store))
            local.release(Ticket(lease, tenant, local))
            await asyncio.gather(*redis_store._tasks)
            continue
        tenant = rng.choice(["t1", "t2", "t3"])
        lease = f"l{i}"
        r = await redis_store.acquire(lease, tenant, limits)
        lo = await local.acquire(lease, tenant, limits)
        assert (r.result, r.in_flight, r.tenant_in_flight) == (lo.result, lo.in_flight, lo.tenant_in_flight)
        if r.result == "admit":
            held.append((lease, tenant))
    assert await redis_store.in_flight() == local.count == len(held)


async def test_unreachable_redis_fails_open_to_local_limits(gates):
    dead = TCPProxy("127.0.0.1", 6379)  # a port nothing listens on
    with structlog.testing.capture_logs() as logs:
        gate = await gates(
            "omnigate-test-dead", url=dead.url, soft_limit=2, hard_limit=4, fail_open_share=0.5
        )
        ctx1, ctx2 = _ctx(), _ctx()
        t1, t2 = await gate.admit(ctx1), await gate.admit(ctx2)
        with pytest.raises(Overloaded):
            await gate.admit(_ctx())  # half of 4 on this replica alone
    assert (ctx1.load.store, ctx2.load.above_soft_limit) == ("local", True)  # half of 2 is 1
    assert [e for e in logs if e["event"] == "traffic_store_unreachable" and e["log_level"] == "error"]
    assert _sample(gate, "omnigate_traffic_store_up") == 0
    assert _sample(gate, "omnigate_admission_fail_open_total") == 3
    assert _sample(gate, "omnigate_admission_duration_seconds_count", {"store": "local"}) == 3
    t1.release()
    t2.release()
    assert gate.store.fallback.count == 0


async def test_outage_and_recovery_through_a_cut_connection(redis_client, prefix, gates):
    proxy = await TCPProxy("127.0.0.1", 6379).start()
    try:
        with structlog.testing.capture_logs() as logs:
            gate = await gates(prefix, url=proxy.url, redis_probe_s=0.1, redis_timeout_s=0.2)
            before = await gate.admit(_ctx())
            assert await _live(redis_client, prefix) == 1

            await proxy.stop()  # Redis vanishes
            during = _ctx()
            local_ticket = await gate.admit(during)
            assert during.load.store == "local" and gate.store.up is False
            assert during.load.in_flight == 1  # alone, the replica still counts the slot it holds in Redis
            before.release()  # its give-back fails; the lease will expire on its own
            await proxy.start()  # and comes back
            assert await eventually(lambda: gate.store.up, 5)
            after = _ctx()
            t = await gate.admit(after)
            assert after.load.store == "redis"
        events = [e["event"] for e in logs]
        assert events.count("traffic_store_unreachable") == 1
        assert "traffic_store_recovered" in events
        local_ticket.release()
        t.release()
        assert gate.store.fallback.count == 0
    finally:
        await proxy.stop()


async def test_a_silent_redis_costs_one_timeout_then_fails_open(prefix, gates):
    proxy = await TCPProxy("127.0.0.1", 6379).start()
    try:
        gate = await gates(prefix, url=proxy.url, redis_timeout_s=0.1, redis_probe_s=5)
        assert gate.store.up is True
        await proxy.stop()
        await proxy.start(mode="blackhole")  # connections are accepted and never answered
        ctx = _ctx()
        t = await asyncio.wait_for(gate.admit(ctx), 2)
        assert ctx.load.store == "local" and gate.store.up is False
        assert _sample(gate, "omnigate_traffic_store_errors_total", {"op": "acquire"}) == 1
        ctx2 = _ctx()
        t2 = await asyncio.wait_for(gate.admit(ctx2), 0.5)  # marked down: no Redis call on the request path
        assert ctx2.load.store == "local"
        t.release()
        t2.release()
    finally:
        await proxy.stop()


async def test_an_admission_cancelled_mid_flight_leaves_no_lease(redis_client, prefix, gates):
    gate = await gates(prefix)
    # Cancelled before its batch is sent, and cancelled while the script runs: neither keeps a slot.
    early = asyncio.create_task(gate.admit(_ctx()))
    await asyncio.sleep(0)
    early.cancel()
    late = asyncio.create_task(gate.admit(_ctx()))
    for _ in range(3):
        await asyncio.sleep(0)
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await early
    # It may have been admitted before the cancel landed: then it is released.
    with contextlib.suppress(asyncio.CancelledError):
        (await late).release()
    await asyncio.gather(*gate.store._tasks)
    assert await eventually(lambda: _zero(redis_client, prefix), 5)
    assert gate.store.held == {}
    ok = await gate.admit(_ctx())
    assert await _live(redis_client, prefix) == 1
    ok.release()


async def test_a_burst_is_decided_in_one_batch_in_arrival_order(redis_client, prefix, gates):
    gate = await gates(prefix)
    redis_store: RedisSlots = gate.store
    local = LocalSlots()
    limits = Limits(soft=2, hard=5, tenant_quota=2)
    tenants = ["a", "b", "a", "a", "c", "b", "b", "c", "a", "c"]
    burst = await asyncio.gather(*(redis_store.acquire(f"l{i}", t, limits) for i, t in enumerate(tenants)))
    one_by_one = [await local.acquire(f"l{i}", t, limits) for i, t in enumerate(tenants)]
    assert [(g.result, g.in_flight, g.tenant_in_flight) for g in burst] == [
        (g.result, g.in_flight, g.tenant_in_flight) for g in one_by_one
    ]
    assert [g.result for g in burst].count("admit") == 5
    assert await _live(redis_client, prefix) == 5
