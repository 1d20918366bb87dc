"""An engine's concurrency cap holds across replicas: two real ``omnigate serve`` processes on one Redis, one
scripted engine that counts the requests it has at once.

Before the caps were shared, each replica kept its own count, so two replicas sent an engine with a cap
of 3 up to 6 requests at once. A replica killed mid-request gives its engine slots back when their
leases expire; with Redis unreachable each replica falls back, as admission does, to a share of the cap.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx
import pytest
import redis
import yaml

from tests.harness import ServeProcess, wait_until
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

REDIS_URL = "redis://127.0.0.1:6379/0"
CAP = 3
LEASE_TTL_S = 1.5
ASK = {"model": "omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class Replica(ServeProcess):
    role = "replica"


@pytest.fixture
def upstream(bg):
    # Each answer takes a while, so that requests pile up at the engine if nothing holds them back.
    up = ScriptedUpstream(Script(flavour="omni", text="slow words", first_byte_delay_s=0.4))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture
def rdb():
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


def _config(upstream: ScriptedUpstream, prefix: str, redis_url: str = REDIS_URL, **traffic) -> dict:
    return {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": upstream.base_url,
                "model": "scripted",
                "serves": ["omni"],
                "max_in_flight": CAP,
                "max_in_flight_overloaded": None,
                "max_wait_s": 60,
                "first_byte_timeout_s": 30,
            }
        ],
        "redis": {"url": redis_url, "timeout_s": 0.3, "probe_s": 0.5},
        "traffic": {
            "soft_limit": 100,
            "hard_limit": 200,
            "key_prefix": prefix,
            "lease_ttl_s": LEASE_TTL_S,
            "heartbeat_s": 0.3,
            **traffic,
        },
        "rate_limits": {"key_prefix": prefix},
        "routing": {"controller": {"enabled": False}},
        "auth": {"required": False},
        "logging": {"level": "info"},
    }


def _start(tmp_path, config: dict, n: int) -> list[Replica]:
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(config))
    made = [Replica(path, tmp_path / f"replica-{i}.log") for i in range(n)]
    try:
        assert wait_until(lambda: all(r.ready() for r in made), timeout=90, interval=0.2)
    except BaseException:
        for r in made:
            r.stop()
        raise
    return made


@pytest.fixture
def replicas(tmp_path, upstream, rdb):
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    made = _start(tmp_path, _config(upstream, prefix), 2)
    try:
        yield made, f"{{{prefix}}}:engine:omni"
    finally:
        for r in made:
            r.stop()
        keys = list(rdb.scan_iter(match=f"*{prefix}*"))
        if keys:
            rdb.delete(*keys)


def _load(urls: list[str], per_url: int) -> list[int]:
    """``per_url`` concurrent non-streamed requests on each of ``urls``; their statuses."""
    statuses: list[int] = []
    lock = threading.Lock()

    def one(url: str) -> None:
        try:
            status = httpx.post(url + "/v1/chat/completions", json=ASK, timeout=120).status_code
        except httpx.HTTPError:
            status = -1
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=one, args=(u,)) for u in urls for _ in range(per_url)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_an_engine_never_has_more_requests_than_its_cap_whatever_the_replica_count(replicas, upstream, rdb):
    (a, b), key = replicas
    upstream.reset_stats()
    statuses = _load([a.url, b.url], per_url=2 * CAP)
    assert statuses == [200] * (4 * CAP)  # they waited for a slot; none was refused
    assert upstream.completed == 4 * CAP
    assert upstream.max_in_flight <= CAP, f"the engine had {upstream.max_in_flight} requests at once"
    assert upstream.max_in_flight == CAP  # and the cap was used, not starved
    assert wait_until(lambda: rdb.zcard(key) == 0, timeout=5)  # every lease given back


def test_a_streaming_requests_lease_is_renewed_for_as_long_as_it_streams(replicas, upstream, rdb, bg):
    """The lease belongs to the request: renewed through many heartbeats while its answer streams (not
    taken for a leak), given back when it ends."""
    (a, b), key = replicas
    long = Script(flavour="omni", text=" ".join(["word"] * 40), chunk_delay_s=0.1)  # about 4 s
    bg.call(lambda: upstream.enqueue(*[long] * CAP))
    body = {**ASK, "stream": True, "max_tokens": 64}
    with httpx.Client(timeout=60) as client:
        opened = [
            client.send(client.build_request("POST", r.url + "/v1/chat/completions", json=body), stream=True)
            for r in (a, b, a)
        ]
        assert [r.status_code for r in opened] == [200] * CAP
        time.sleep(2.0)  # several heartbeats (0.3 s) and more than one lease TTL (1.5 s)
        assert rdb.zcard(key) == CAP
        for r in opened:
            r.read()
            r.close()
    assert wait_until(lambda: rdb.zcard(key) == 0, timeout=5)
    for r in (a, b):
        log = r.log_path.read_text()
        assert "engine_lease_leaked" not in log and "engine_lease_lost" not in log


def test_a_killed_replicas_engine_slots_come_back_when_their_leases_expire(replicas, upstream, rdb, bg):
    (a, b), key = replicas
    upstream.reset_stats()
    slow = Script(flavour="omni", text="slow words", first_byte_delay_s=30)
    bg.call(lambda: upstream.enqueue(*[slow] * CAP))
    held = [
        threading.Thread(target=_load, args=([a.url], 1), daemon=True) for _ in range(CAP)
    ]  # the engine's whole cap, taken through a
    for t in held:
        t.start()
    assert wait_until(lambda: upstream.in_flight == CAP, timeout=30)
    assert rdb.zcard(key) == CAP
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    killed_at = time.monotonic()
    # Nobody gives them back: b's requests wait until the dead replica's leases expire, then are served.
    assert wait_until(lambda: rdb.zcard(key) == 0, timeout=LEASE_TTL_S * 6, interval=0.05)
    assert time.monotonic() - killed_at > LEASE_TTL_S * 0.5
    upstream.reset_stats()
    assert _load([b.url], per_url=CAP + 1) == [200] * (CAP + 1)
    assert upstream.max_in_flight <= CAP


def test_with_redis_unreachable_each_replica_keeps_a_share_of_the_cap(tmp_path, upstream):
    """As admission does when its store is down: each replica alone applies ``fail_open_share`` of the
    cap (never below one), loudly, rather than refusing or sending the whole cap from every replica."""
    dead = "redis://127.0.0.1:1/0"  # nothing listens there
    (alone,) = _start(
        tmp_path, _config(upstream, f"omnigate-test:{uuid.uuid4().hex}", dead, fail_open_share=0.5), 1
    )
    try:
        upstream.reset_stats()
        assert _load([alone.url], per_url=2 * CAP) == [200] * (2 * CAP)
        assert upstream.max_in_flight == max(1, CAP // 2)
        assert "engine_caps_store_unreachable" in alone.log_path.read_text()
    finally:
        alone.stop()


# -- the same, in one process: two pools standing for two replicas, one Redis -------------------------------
def _pools(prefix: str, *caps: int):
    import redis.asyncio as aioredis
    from prometheus_client import CollectorRegistry

    from engines.adapters.settings import EngineConfig
    from engines.selection.pool import EnginePool, SharedCaps, build_engine
    from observability.metrics import Metrics

    pools = []
    for replica in ("a", "b"):
        engines = [
            build_engine(
                EngineConfig(
                    name=f"e{i}",
                    kind="vllm",
                    base_url="http://127.0.0.1:9/v1",
                    model="m",
                    serves=["x"],
                    max_in_flight=cap,
                    max_in_flight_overloaded=None,
                    max_wait_s=2,
                )
            )
            for i, cap in enumerate(caps)
        ]
        metrics = Metrics(CollectorRegistry())
        pool = EnginePool(engines, metrics)
        for e in engines:
            pool._set_health(e, True)
        pool.share_caps(
            SharedCaps(
                aioredis.from_url(REDIS_URL),
                metrics,
                key_prefix=prefix,
                lease_ttl_s=5,
                heartbeat_s=1,
                timeout_s=1,
                probe_s=1,
                fail_open_share=1.0,
                replica_id=replica,
            )
        )
        pools.append(pool)
    return pools


async def test_a_request_spills_over_to_an_engine_with_room_and_a_freed_slot_keeps_its_lease(rdb):
    import asyncio

    from core.errors import EngineBusy

    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    a, b = _pools(prefix, 1, 1)
    key = f"{{{prefix}}}:engine:"
    for p in (a, b):
        await p.slots.shared.start()
    try:
        order = list(a.engines.values())
        first = await a.lease(order, "x")
        assert first is not None and first.engine.name == "e0"
        # e0 is full on a: b's request, asking for e0 first, is sent to e1.
        second = await b.lease(list(b.engines.values()), "x")
        assert second is not None and second.engine.name == "e1"
        assert rdb.zcard(key + "e0") == 1 and rdb.zcard(key + "e1") == 1
        # Every engine is full across the replicas: a request on a waits, then is refused.
        with pytest.raises(EngineBusy):
            await a.lease(order, "x")
        # A waiter on b gets e1 once b's own request lets go of it: the slot passes with its lease.
        waiting = asyncio.create_task(b.lease(list(b.engines.values()), "x"))
        await asyncio.sleep(0.2)
        second.settle(reported=True)
        third = await waiting
        assert third is not None and third.engine.name == "e1"
        assert rdb.zcard(key + "e1") == 1
        # e0 freed on a: a request on b takes it (it polls Redis for the slot another replica freed).
        waiting = asyncio.create_task(b.lease(list(b.engines.values()), "x"))
        await asyncio.sleep(0.2)
        first.settle(reported=True)
        fourth = await waiting
        assert fourth is not None and fourth.engine.name == "e0"
        third.settle(reported=True)
        fourth.settle(reported=True)
        await asyncio.sleep(0.2)
        assert rdb.zcard(key + "e0") == 0 and rdb.zcard(key + "e1") == 0
    finally:
        for p in (a, b):
            await p.slots.shared.aclose()
