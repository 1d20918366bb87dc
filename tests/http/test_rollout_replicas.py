"""Two gateway replicas sharing the controller through Redis: one leads, both route by the same table.

Uses the Redis at 127.0.0.1:6379 under a key prefix of its own per test.
"""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.rollback import ControllerState
from engines.rollout.rules import Rule, RuleAction, RuleSelector
from engines.rollout.settings import SharedStateSettings
from engines.rollout.state_store import NotLeader, RedisStore
from gateway.redis_client import SharedRedis
from gateway.traffic_settings import RedisSettings
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import MODEL, REDIS, admin, chat, engines, settings
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)

RULE = Rule(
    name="int4-latency",
    select=RuleSelector(variants=["int4"]),
    signal="ttft_p99",
    above=0.15,
    for_s=0.3,
    min_samples=5,
    recover_below=0.05,
    recover_for_s=0.5,
    action=RuleAction(kind="shift", to_variants=["bf16"], trickle_weight=0.0),
)


def _replica(bg, trio, prefix: str, name: str, rules=(RULE,)) -> GatewayServer:
    state = SharedStateSettings(backend="redis", key_prefix=prefix, lease_ttl_s=1.0, replica_id=name)
    return GatewayServer(bg, settings(engines(trio), list(rules), state=state), CollectorRegistry()).start()


def _status(server: GatewayServer) -> dict:
    return admin(server.url, "").json()


def test_one_replica_leads_both_follow_its_switch_and_signals_from_both_count(bg, trio, prefix):
    trio.reset()
    a = _replica(bg, trio, prefix, "replica-a")
    b = _replica(bg, trio, prefix, "replica-b")
    try:
        assert wait_until(lambda: _status(a)["leader"] in ("replica-a", "replica-b"), timeout=10)
        sa, sb = _status(a), _status(b)
        assert sa["leader"] == sb["leader"] and sa["is_leader"] != sb["is_leader"]
        leader, follower = (a, b) if sa["is_leader"] else (b, a)

        # Only the follower serves traffic: the leader decides on the follower's measurements.
        trio.set(trio.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
        answers = []
        assert wait_until(
            lambda: (
                answers.append(chat(follower.url)) or _status(leader)["weights"][MODEL]["omni-bf16"] == 1.0
            ),
            timeout=60,
            interval=0,
        )
        assert all(x.ok for x in answers)
        assert wait_until(lambda: _status(follower)["weights"][MODEL]["omni-bf16"] == 1.0, timeout=10)
        assert _status(follower)["version"] == _status(leader)["version"]
        leader_shifts = [t for t in _status(leader)["recent_transitions"] if t["action"] == "shift"]
        assert len(leader_shifts) == 1 and leader_shifts[0]["reason"] == "int4-latency"
        assert not [
            t for t in _status(follower)["recent_transitions"] if t["action"] == "shift"
        ]  # counted once
        assert (
            follower.registry.get_sample_value(
                "omnigate_routing_transitions_total",
                {"action": "shift", "reason": "int4-latency", "source": "auto"},
            )
            is None
        )

        before = trio.counts()
        for server in (a, b):
            assert all(chat(server.url).ok for _ in range(5))
        now = trio.counts()
        assert now["int4"] == before["int4"] and now["bf16"] == before["bf16"] + 10

        # A manual pin through the follower is the leader's state too.
        r = admin(follower.url, "/pin", {"model": MODEL, "variant": "int8", "note": "drill"})
        assert r.status_code == 200 and r.json()["changed"]
        assert wait_until(lambda: _status(leader)["pins"] == {MODEL: "int8"}, timeout=10)  # its next tick
        assert wait_until(lambda: _status(leader)["weights"][MODEL]["omni-int8"] == 1.0, timeout=10)
        assert all(chat(leader.url).ok for _ in range(3))
        assert trio.counts()["int8"] == 3
    finally:
        b.stop()
        a.stop()


def test_the_follower_takes_over_with_the_state_when_the_leader_stops(bg, trio, prefix):
    trio.reset()
    a = _replica(bg, trio, prefix, "replica-a")
    assert wait_until(lambda: _status(a)["is_leader"], timeout=10)
    b = _replica(bg, trio, prefix, "replica-b")
    stopped = False
    try:
        assert admin(a.url, "/freeze", {"note": "handover drill"}).json()["frozen"]
        assert not _status(b)["is_leader"]
        a.stop()
        stopped = True
        assert wait_until(lambda: _status(b)["is_leader"], timeout=10)
        st = _status(b)
        assert st["leader"] == "replica-b" and st["frozen"] is True  # the state came along
        assert b.registry.get_sample_value("omnigate_controller_leader") == 1
    finally:
        b.stop()
        if not stopped:
            a.stop()


async def test_redis_store_lease_is_exclusive_and_writes_are_fenced_on_it(prefix):
    redis = SharedRedis(
        RedisSettings(url=REDIS)
    )  # the two replicas' stores over one pool, as two gateways would
    one = RedisStore(redis.client(), prefix, "one")
    two = RedisStore(redis.client(), prefix, "two")
    try:
        assert await one.acquire_lease(5) and not await two.acquire_lease(5)
        assert await one.acquire_lease(5)  # renewal
        assert await two.leader() == "one"

        def bump(doc):
            state = ControllerState.from_dict(doc.state)
            return {**state.to_dict(), "frozen": True}, {"weights": {}}

        doc, changed = await one.update(bump, fenced=True)
        assert changed and doc.version == 1 and await two.version() == 1
        with pytest.raises(NotLeader):
            await two.update(bump, fenced=True)
        await one.release_lease()
        assert await two.acquire_lease(5)
        doc, changed = await two.update(bump, fenced=True)
        assert doc.version == 2 and (await one.load()).state["frozen"] is True

        # Concurrent unfenced updates (admin calls on two replicas) both land: WATCH retries the loser.
        import asyncio

        def add(name):
            def fn(doc):
                pins = dict(doc.state.get("pins") or {})
                pins[name] = "bf16"
                return {**doc.state, "pins": pins}, doc.table

            return fn

        await asyncio.gather(*(s.update(add(f"m{i}")) for i, s in enumerate([one, two] * 5)))
        final = await one.load()
        assert set(final.state["pins"]) == {f"m{i}" for i in range(10)} and final.version == 12

        await one.publish_summary({"e": {"ok": 1}}, ttl_s=5)
        await two.publish_summary({"e": {"ok": 2}}, ttl_s=5)
        assert await one.summaries(max_age_s=5) == {"one": {"e": {"ok": 1}}, "two": {"e": {"ok": 2}}}
        await two.withdraw()
        assert list(await one.summaries(max_age_s=5)) == ["one"]
    finally:
        await one.aclose()
        await two.aclose()
        await redis.aclose()


async def test_redis_store_lease_is_kept_by_renewal_and_lapses_to_another_replica(prefix):
    """A leader that renews keeps the lead past its TTL; one that stops (dies) loses it to the next taker."""
    import asyncio

    redis = SharedRedis(RedisSettings(url=REDIS))
    one = RedisStore(redis.client(), prefix, "one")
    two = RedisStore(redis.client(), prefix, "two")
    raw = redis.client()
    ttl = 1.0
    try:
        assert await one.acquire_lease(ttl)
        await two.release_lease()  # a replica that does not hold the lease gives nothing back
        assert await two.leader() == "one"
        for _ in range(4):  # renewed every 0.3 s, the lease outlives its TTL
            await asyncio.sleep(0.3)
            assert await one.acquire_lease(ttl) and not await two.acquire_lease(ttl)
            assert 0.5 * ttl * 1000 < await raw.pttl(f"{prefix}:leader") <= ttl * 1000
        await asyncio.sleep(ttl + 0.3)  # "one" stops renewing: the lease lapses, nobody released it
        assert await one.leader() is None
        assert await two.acquire_lease(ttl) and await two.leader() == "two"
        assert not await one.acquire_lease(ttl)  # the old leader does not take it back

        def bump(doc):
            return {**doc.state, "frozen": True}, {"weights": {}}

        with pytest.raises(NotLeader):
            await one.update(bump, fenced=True)
        await one.release_lease()  # the old leader's shutdown leaves the new leader's lease alone
        assert await one.leader() == "two"
        await two.release_lease()
        assert await one.leader() is None and await one.acquire_lease(ttl)
    finally:
        await raw.aclose()
        await one.aclose()
        await two.aclose()
        await redis.aclose()


def test_a_replica_that_cannot_reach_redis_serves_with_the_configured_split(bg, trio, prefix):
    trio.reset()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]  # nothing listens here once the socket closes
    state = SharedStateSettings(backend="redis", key_prefix=prefix, lease_ttl_s=1.0)
    registry = CollectorRegistry()
    cfg = settings(engines(trio), [RULE], state=state, redis_url=f"redis://127.0.0.1:{dead}/0")
    server = GatewayServer(bg, cfg, registry).start()
    try:
        assert all(chat(server.url).ok for _ in range(3))
        assert trio.counts()["int4"] == 3
        st = _status(server)
        assert st["leader"] is None and not st["is_leader"]
        assert st["weights"][MODEL]["omni-int4"] == 1.0
        assert registry.get_sample_value("omnigate_controller_errors_total", {"stage": "store"}) == 1
        assert wait_until(
            lambda: (
                (registry.get_sample_value("omnigate_controller_errors_total", {"stage": "tick"}) or 0) >= 2
            )
        )
    finally:
        server.stop()
