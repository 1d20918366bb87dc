"""Two real ``omnigate serve`` processes sharing one admission limit through the real Redis, and a replica
killed with SIGKILL whose slots come back by themselves once its leases expire."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid

import httpx
import pytest
import redis
import yaml

from tests.harness import ServeProcess, wait_until
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

REDIS_URL = "redis://127.0.0.1:6379/0"
LEASE_TTL_S = 1.5
SPEECH = {
    "model": "omni",
    "stream": True,
    "messages": [{"role": "user", "content": "Talk to me."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Ethan", "format": "wav"},
}


@pytest.fixture(scope="module")
def upstream(bg):
    up = ScriptedUpstream(Script(flavour="omni", text=" ".join(["word"] * 400), chunk_delay_s=0.05))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture
def rdb():
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


class Replica(ServeProcess):
    role = "replica"

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)


@pytest.fixture
def replicas(tmp_path, upstream, rdb):
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    config = {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": upstream.base_url,
                "model": "scripted",
                "serves": ["omni"],
                "max_in_flight": 16,
            }
        ],
        "policies": {"pre": [{"name": "load-shedding"}, {"name": "request-limits"}]},
        "redis": {"url": REDIS_URL},
        "traffic": {
            "soft_limit": 2,
            "hard_limit": 4,
            "key_prefix": prefix,
            "lease_ttl_s": LEASE_TTL_S,
            "heartbeat_s": 0.3,
            "monitor_interval_s": 0.1,
        },
        "logging": {"level": "info"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(config))
    made = [Replica(path, tmp_path / f"replica-{i}.log") for i in range(2)]
    try:
        assert wait_until(lambda: all(r.ready() for r in made), timeout=60, interval=0.2)
        yield made, f"{{{prefix}}}:slots"
    finally:
        for r in made:
            r.stop()
        keys = list(rdb.scan_iter(match=f"{{{prefix}}}:*"))
        if keys:
            rdb.delete(*keys)


def _open(client: httpx.Client, replica: Replica) -> httpx.Response:
    return client.send(
        client.build_request("POST", replica.url + "/v1/chat/completions", json=SPEECH), stream=True
    )


def _degraded(resp: httpx.Response) -> str | None:
    return resp.headers.get("x-omnigate-degraded")


def test_two_replicas_share_one_limit(replicas, rdb, upstream):
    (a, b), key = replicas
    with httpx.Client(timeout=20) as client:
        opened = [_open(client, r) for r in (a, b, a, b)]
        assert [r.status_code for r in opened] == [200] * 4
        assert [_degraded(r) for r in opened] == [None, None, "load-text-only", "load-text-only"]
        assert rdb.zcard(key) == 4
        for r in (a, b):
            refused = client.post(r.url + "/v1/chat/completions", json=SPEECH)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
        assert wait_until(lambda: b.metric("omnigate_admission_in_flight") == 4, timeout=5)

        opened.pop(0).close()  # a slot taken on a frees a slot on b
        assert wait_until(lambda: rdb.zcard(key) == 3, timeout=5)
        again = _open(client, b)
        assert again.status_code == 200 and _degraded(again) == "load-text-only"
        for r in (*opened, again):
            r.close()
    assert wait_until(lambda: rdb.zcard(key) == 0, timeout=5)


def test_killed_replica_slots_come_back_after_the_lease_ttl(replicas, rdb, upstream):
    (a, b), key = replicas
    with httpx.Client(timeout=20) as client:
        kept = _open(client, b)
        kept_since = time.monotonic()
        on_a = [_open(client, a) for _ in range(3)]
        assert [r.status_code for r in (kept, *on_a)] == [200] * 4
        assert client.post(b.url + "/v1/chat/completions", json=SPEECH).status_code == 503

        aborts_before = upstream.aborts
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        killed_at = time.monotonic()
        # Its leases are still in Redis: b keeps refusing until they expire.
        assert client.post(b.url + "/v1/chat/completions", json=SPEECH).status_code == 503
        assert wait_until(lambda: rdb.zcard(key) == 1, timeout=LEASE_TTL_S * 4, interval=0.05)
        assert time.monotonic() - killed_at > LEASE_TTL_S * 0.5  # they expired; nobody released them
        # b's own stream outlives two lease TTLs and stays counted: its heartbeat renews it.
        time.sleep(max(0.0, kept_since + 2 * LEASE_TTL_S - time.monotonic()))
        assert rdb.zcard(key) == 1
        more = [_open(client, b) for _ in range(3)]
        assert [r.status_code for r in more] == [200] * 3
        assert client.post(b.url + "/v1/chat/completions", json=SPEECH).status_code == 503
        assert upstream.aborts >= aborts_before + 3  # the dead replica's engine requests were dropped too
        for r in (kept, *more):
            r.close()
        for r in on_a:
            with contextlib.suppress(httpx.HTTPError):
                r.close()
    assert wait_until(lambda: rdb.zcard(key) == 0, timeout=5)


# -- a spoken answer's audio id, served by one replica and sent back to another ---------------------------
SAID = "Paris it is."


@pytest.fixture
def speaking_replicas(bg, tmp_path, rdb):
    up = ScriptedUpstream(Script(flavour="omni", text=SAID, audio_chunks=2))
    bg.run(up.start())
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    config = {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": up.base_url,
                "model": "scripted",
                "serves": ["omni"],
            }
        ],
        "redis": {"url": REDIS_URL},
        "rate_limits": {"key_prefix": prefix},
        "logging": {"level": "info"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(config))
    made = [Replica(path, tmp_path / f"speaker-{i}.log") for i in range(2)]
    try:
        assert wait_until(lambda: all(r.ready() for r in made), timeout=60, interval=0.2)
        yield made, up, prefix
    finally:
        for r in made:
            r.stop()
        bg.run(up.stop())
        keys = list(rdb.scan_iter(match=f"{prefix}:*"))
        if keys:
            rdb.delete(*keys)


def test_an_audio_id_one_replica_served_resolves_on_another(speaking_replicas, rdb):
    (a, b), up, prefix = speaking_replicas
    speech = {"model": "omni", "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
    first = [{"role": "user", "content": "Capital of France?"}]
    with httpx.Client(timeout=20) as client:
        answer = client.post(a.url + "/v1/chat/completions", json={**speech, "messages": first})
        assert answer.status_code == 200, answer.text
        audio = answer.json()["choices"][0]["message"]["audio"]
        # Kept in the shared Redis, expiring with the audio.
        ttl = rdb.pttl(f"{prefix}:answer-audio:{audio['id']}")
        assert 0 < ttl <= (audio["expires_at"] - time.time() + 5) * 1000

        turns = [
            *first,
            {"role": "assistant", "audio": {"id": audio["id"]}},
            {"role": "user", "content": "Again?"},
        ]
        again = client.post(b.url + "/v1/chat/completions", json={**speech, "messages": turns})
        assert again.status_code == 200, again.text
        assert [m for m in up.requests[-1]["messages"] if m["role"] == "assistant"] == [
            {"role": "assistant", "content": SAID}
        ]
        rdb.delete(f"{prefix}:answer-audio:{audio['id']}")  # expired: gone from Redis, on every replica
        for r in (a, b):
            gone = client.post(r.url + "/v1/chat/completions", json={**speech, "messages": turns})
            assert gone.status_code == 400 and gone.json()["error"]["code"] == "audio_not_found"
