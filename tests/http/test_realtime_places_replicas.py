"""One key's realtime session cap holds across replicas: two real ``omnigate serve`` processes on one Redis,
``realtime.max_sessions_per_key: 2``.

Before the places were shared, each replica kept its own count, so a key could hold two sessions on each.
A session's place is given back when it ends, renewed while it lives (a session outlives many lease TTLs),
and a killed replica's places come back when their leases expire. With Redis unreachable each replica
falls back, as admission does, to a share of the cap (``traffic.fail_open_share``).
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest
import redis
import yaml
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.tenants import MintedKey, mint_key
from tests.harness import ServeProcess, wait_until
from tests.http.realtime_helpers import Client
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

REDIS_URL = "redis://127.0.0.1:6379/0"
CAP = 2
LEASE_TTL_S = 1.5


class Replica(ServeProcess):
    role = "replica"


@pytest.fixture
def upstream(bg):
    up = ScriptedUpstream(Script(flavour="omni", text="Hello there."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture
def rdb():
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def key() -> MintedKey:
    return mint_key()


def _config(
    upstream: ScriptedUpstream, key: MintedKey, prefix: str, redis_url: str = REDIS_URL, **traffic
) -> dict:
    return {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": upstream.base_url,
                "model": "scripted",
                "serves": ["omni"],
            }
        ],
        "tenants": [{"name": "voice", "models": ["omni"]}],
        "api_keys": [{"id": key.id, "tenant": "voice", "sha256": key.sha256}],
        "realtime": {"max_sessions_per_key": CAP},
        "redis": {"url": redis_url, "timeout_s": 0.3, "probe_s": 0.5},
        "traffic": {"key_prefix": prefix, "lease_ttl_s": LEASE_TTL_S, "heartbeat_s": 0.3, **traffic},
        "rate_limits": {"key_prefix": prefix},
        "routing": {"controller": {"enabled": False}},
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
def replicas(tmp_path, upstream, rdb, key):
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    made = _start(tmp_path, _config(upstream, key, prefix), 2)
    try:
        yield made, f"{{{prefix}}}:realtime:{key.id}"
    finally:
        for r in made:
            r.stop()
        keys = list(rdb.scan_iter(match=f"*{prefix}*"))
        if keys:
            rdb.delete(*keys)


def _open(replica: Replica, key: MintedKey) -> Client:
    c = Client(replica.url, key.key, model="omni")
    c.until("session.created")
    return c


def _refused(replica: Replica, key: MintedKey) -> None:
    with pytest.raises(InvalidStatus) as refused:
        Client(replica.url, key.key, model="omni").close()
    assert refused.value.response.status_code == 429
    assert json.loads(refused.value.response.body)["error"]["code"] == "rate_limit_exceeded"


def _opens(replica: Replica, key: MintedKey) -> bool:
    try:
        _open(replica, key).close()
    except InvalidStatus:
        return False
    return True


def _open_when_free(replica: Replica, key: MintedKey, timeout: float = 5) -> Client:
    """A session, once a place is free (a client's close returns before the server has given it back)."""
    opened: list[Client] = []

    def attempt() -> bool:
        try:
            opened.append(_open(replica, key))
        except InvalidStatus:
            return False
        return True

    assert wait_until(attempt, timeout=timeout, interval=0.05)
    return opened[0]


def test_one_keys_sessions_are_capped_across_replicas(replicas, key, rdb):
    (a, b), places = replicas
    first, second = _open(a, key), _open(b, key)
    try:
        # the cap is the key's, whichever replica the third handshake reaches
        _refused(a, key)
        _refused(b, key)
        assert rdb.zcard(places) == CAP
        # a session lives past several lease TTLs: its place is renewed, not lost
        time.sleep(LEASE_TTL_S * 2)
        assert rdb.zcard(places) == CAP
        _refused(b, key)
        first.close()
        # the closed session's place is free, for a session on the other replica
        third = _open_when_free(b, key)
        _refused(a, key)
        third.close()
    finally:
        first.close()
        second.close()
    assert wait_until(lambda: rdb.zcard(places) == 0, timeout=5)  # every place given back
    for r in (a, b):
        log = r.log_path.read_text()
        assert "realtime_place_leaked" not in log and "realtime_place_lost" not in log


def test_a_killed_replicas_places_come_back_when_their_leases_expire(replicas, key, rdb):
    (a, b), places = replicas
    held = [_open(a, key), _open(a, key)]
    _refused(b, key)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    killed_at = time.monotonic()
    # Nobody gives them back, nobody renews them: they expire one lease TTL after the last heartbeat.
    assert wait_until(lambda: _opens(b, key), timeout=LEASE_TTL_S * 6, interval=0.1)
    assert time.monotonic() - killed_at > LEASE_TTL_S * 0.5
    for c in held:
        c.close()
    assert wait_until(lambda: rdb.zcard(places) == 0, timeout=5)


def test_with_redis_unreachable_a_replica_keeps_a_share_of_the_cap(tmp_path, upstream, key):
    """As admission does when its store is down: each replica alone applies ``fail_open_share`` of the
    cap (never below one), loudly, rather than refusing every session or giving each replica the whole cap."""
    dead = "redis://127.0.0.1:1/0"  # nothing listens there
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    (alone,) = _start(tmp_path, _config(upstream, key, prefix, dead, fail_open_share=0.5), 1)
    try:
        only = _open(alone, key)  # floor(2 * 0.5) = 1 session for this key on this replica
        _refused(alone, key)
        only.close()
        assert wait_until(lambda: _opens(alone, key), timeout=5)
        assert "realtime_places_store_unreachable" in alone.log_path.read_text()
    finally:
        alone.stop()


def test_places_go_back_when_the_server_ends_a_session_and_at_shutdown(tmp_path, upstream, key, rdb):
    """Not left to expire: a lease TTL longer than the test, so only a give-back empties the set."""
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    places = f"{{{prefix}}}:realtime:{key.id}"
    (a,) = _start(tmp_path, _config(upstream, key, prefix, lease_ttl_s=60.0, heartbeat_s=1.0), 1)
    try:
        abusive = _open(a, key)
        for _ in range(16):  # realtime.max_errors: the server closes the session (1008)
            abusive.ws.send("garbage")
        with pytest.raises(ConnectionClosed):
            while True:
                abusive.ws.recv(timeout=10)
        abusive.close()
        assert wait_until(lambda: rdb.zcard(places) == 0, timeout=5)
        held = [_open(a, key), _open(a, key)]
        assert rdb.zcard(places) == CAP
        a.stop()  # SIGTERM: the sessions are ended by the shutdown, their places given back
        assert a.proc.returncode is not None
        assert rdb.zcard(places) == 0
        for c in held:
            c.close()
    finally:
        a.stop()
        keys = list(rdb.scan_iter(match=f"*{prefix}*"))
        if keys:
            rdb.delete(*keys)
