"""What a request holds is given back however it ends: a client gone mid-body, a cancelled task, a server
error. Raw sockets against a served gateway over the scripted engines; each way out leaves the admission
count, the tenant's quota and the in-flight gauge at zero, and one audit record saying how it ended.

Also here: ``/readyz`` reports a gateway that cannot admit, and the dropped-fields header carries any
field name a client sends as a valid header value.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import uuid

import httpx
import orjson
import pytest
import structlog
from prometheus_client import CollectorRegistry
from redis import asyncio as aioredis

from core.context import RequestContext
from gateway.admission import AdmissionGate
from gateway.redis_client import SharedRedis
from gateway.tenants import mint_key
from gateway.traffic_settings import RedisSettings, TrafficSettings
from observability.metrics import Metrics
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, eventually
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

REDIS_URL = "redis://127.0.0.1:6379/0"
LONG = " ".join(["word"] * 200)
TEXT = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "Hello."}]}
SPEECH = {
    "model": OMNI_MODEL,
    "stream": True,
    "messages": [{"role": "user", "content": "Talk to me."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Ethan", "format": "wav"},
}


@pytest.fixture
def serve(bg, upstreams, tmp_path):
    servers: list[GatewayServer] = []

    def _make(**extra) -> GatewayServer:
        upstreams.reset()
        db = tmp_path / f"audit-{len(servers)}.db"
        settings = gateway_settings(
            upstreams,
            PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
            audit={"sqlite_path": str(db)},
            **extra,
        )
        server = GatewayServer(bg, settings, CollectorRegistry()).start()
        server.db = db
        servers.append(server)
        return server

    yield _make
    for s in servers:
        s.stop()


def _records(server: GatewayServer) -> list[dict]:
    db = sqlite3.connect(server.db)
    try:
        rows = db.execute("SELECT data FROM audit_log WHERE kind = 'request' ORDER BY seq").fetchall()
    finally:
        db.close()
    return [orjson.loads(r[0])["payload"] for r in rows]


def _metric(server: GatewayServer, name: str, labels: dict | None = None) -> float:
    return server.registry.get_sample_value(name, labels or {}) or 0.0


def _held(server: GatewayServer) -> tuple[int, dict[str, int], float]:
    def read() -> tuple[int, dict[str, int], float]:
        store = server.services.admission.store
        return store.count, dict(store.tenants), _metric(server, "omnigate_requests_in_flight")

    return server.bg.call(read)


def _drop_mid_body(port: int, headers: dict[str, str] | None = None) -> None:
    """A POST that promises 1,000 body bytes, sends ten and closes the connection."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: 1000\r\n{extra}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + b'{"model": ')


async def _drop_uploads(server: GatewayServer, n: int, headers: dict[str, str] | None = None) -> None:
    await asyncio.gather(*(asyncio.to_thread(_drop_mid_body, server.port, headers) for _ in range(n)))


async def test_uploads_dropped_mid_body_give_back_their_slots(serve):
    server = serve(traffic={"soft_limit": 16, "hard_limit": 64})
    await _drop_uploads(server, 64)
    # The server notices each closed connection; nothing may stay held once it has.
    assert await eventually(lambda: _held(server) == (0, {}, 0.0), timeout=10), _held(server)
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(server.url + "/v1/chat/completions", json=TEXT)
    assert r.status_code == 200, r.text
    # One record each: cancelled by the client, with the nginx convention's status.
    assert await eventually(lambda: len(_records(server)) == 65, timeout=10)
    dropped = [p for p in _records(server) if p["outcome"] == "cancelled"]
    assert len(dropped) == 64
    assert {(p["status"], p["error_code"]) for p in dropped} == {(499, "client_closed_request")}
    assert _metric(server, "omnigate_requests_total", {"model": "unknown", "outcome": "cancelled"}) == 64


async def test_a_tenants_aborted_uploads_do_not_use_up_its_quota(serve):
    key = mint_key()
    server = serve(
        traffic={"soft_limit": 16, "hard_limit": 64},
        tenants=[{"name": "acme", "max_concurrency": 2}],
        api_keys=[{"id": key.id, "tenant": "acme", "sha256": key.sha256}],
    )
    auth = {"authorization": f"Bearer {key.key}"}
    await _drop_uploads(server, 8, auth)
    assert await eventually(lambda: _held(server) == (0, {}, 0.0), timeout=10), _held(server)
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(server.url + "/v1/chat/completions", json=TEXT, headers=auth)
    assert r.status_code == 200, r.text


async def test_aborted_uploads_leave_no_lease_in_redis(serve, bg):
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    server = serve(
        traffic={"soft_limit": 4, "hard_limit": 8, "key_prefix": prefix},
        # A loaded test machine can be slower than the production default of 0.25 s.
        redis={"url": REDIS_URL, "timeout_s": 2.0, "probe_s": 0.2},
    )
    assert await eventually(lambda: bg.call(lambda: server.services.admission.store.up), timeout=10)
    redis = aioredis.from_url(REDIS_URL)
    try:
        await _drop_uploads(server, 16)

        async def shared() -> int:
            return int(await redis.zcard(f"{{{prefix}}}:slots"))

        assert await eventually(lambda: _zero(shared), timeout=10), await shared()
        # The replica's own book of its leases follows the shared count: a lease whose request ended
        # without giving it back leaves it at the next heartbeat (gateway/admission.py, _leaked).
        assert await eventually(
            lambda: bg.call(lambda: server.services.admission.store.held) == {}, timeout=20
        ), bg.call(lambda: dict(server.services.admission.store.held))
        async with httpx.AsyncClient(timeout=20) as client:
            r = await client.post(server.url + "/v1/chat/completions", json=TEXT)
        assert r.status_code == 200, r.text
        assert await eventually(lambda: _zero(shared), timeout=10)
    finally:
        keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


async def _zero(count) -> bool:
    return await count() == 0


async def test_a_lease_whose_request_ended_is_not_renewed_but_given_back():
    """Renewal follows the request, not the replica: a live replica does not keep a dead request's slot."""
    prefix = f"omnigate-test:{uuid.uuid4().hex}"
    cfg = TrafficSettings(key_prefix=prefix, soft_limit=1, hard_limit=2, lease_ttl_s=1.0, heartbeat_s=0.1)
    shared = SharedRedis(RedisSettings(url=REDIS_URL, timeout_s=2.0, probe_s=0.2))
    gate = AdmissionGate(cfg, Metrics(CollectorRegistry()), redis=shared)
    redis = aioredis.from_url(REDIS_URL)

    async def live() -> int:
        return int(await redis.zcard(f"{{{prefix}}}:slots"))

    async def one() -> bool:
        return await live() == 1

    await gate.start()
    try:
        assert await eventually(lambda: gate.store.up, timeout=10)
        kept = await gate.admit(RequestContext.new("kept"))  # this task's request is alive throughout

        async def leaky_request() -> None:
            await gate.admit(RequestContext.new("leaked"))  # ends without giving its slot back

        with structlog.testing.capture_logs() as logs:
            await asyncio.create_task(leaky_request())
            assert await live() == 2
            assert await eventually(one, timeout=5), await live()
            # Several TTLs later the live request's lease is still there: renewed, the leaked one not.
            await asyncio.sleep(2.5)
            assert await live() == 1
        # Lease ids count up per replica: the kept request's is the first, the leaked one's the second.
        leaked = [e["leases"] for e in logs if e["event"] == "admission_lease_leaked"]
        assert leaked == [[f"{gate.replica_id}:2"]]
        renewals = gate.metrics.registry.get_sample_value
        assert renewals("omnigate_admission_lease_renewals_total", {"result": "leaked"}) == 1
        kept.release()
        assert await eventually(lambda: _zero(live), timeout=5)
    finally:
        await gate.aclose()
        await shared.aclose()
        keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


def _scope(server: GatewayServer, rid: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", b"1000"),
            (b"x-client-request-id", rid.encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", server.port),
        "state": {},
        "app": server.app,
    }


async def test_a_request_cancelled_mid_body_gives_back_its_slot(serve, bg):
    """The server cancels the request's task (as it does at shutdown) while the body is still coming."""
    server = serve(traffic={"soft_limit": 1, "hard_limit": 1})
    sent: list[dict] = []
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"model": ', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        task = asyncio.create_task(server.app(_scope(server, "cancelled-mid-body"), receive, send))
        assert await eventually(lambda: server.services.admission.store.count == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(5):
                await task

    bg.run(run())
    assert _held(server) == (0, {}, 0.0)
    assert await eventually(lambda: len(_records(server)) == 1, timeout=10)
    (record,) = _records(server)
    assert (record["client_request_id"], record["outcome"]) == ("cancelled-mid-body", "cancelled")
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(server.url + "/v1/chat/completions", json=TEXT)
    assert r.status_code == 200, r.text


async def test_a_server_error_mid_body_gives_back_its_slot(serve, bg):
    """A fault under the body read that is no OmnigateError: a 500, a record, and the slot back."""
    server = serve(traffic={"soft_limit": 1, "hard_limit": 1})
    sent: list[dict] = []
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"model": ', "more_body": True}
        raise RuntimeError("the receive channel broke")

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        with pytest.raises(RuntimeError):
            async with asyncio.timeout(5):
                await server.app(_scope(server, "server-error-mid-body"), receive, send)

    bg.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    assert b"the receive channel broke" not in b"".join(m.get("body", b"") for m in sent)
    assert _held(server) == (0, {}, 0.0)
    assert await eventually(lambda: len(_records(server)) == 1, timeout=10)
    (record,) = _records(server)
    assert (record["outcome"], record["status"], record["error_code"]) == ("failed", 500, "internal_error")
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(server.url + "/v1/chat/completions", json=TEXT)
    assert r.status_code == 200, r.text


async def test_readyz_says_when_the_gateway_cannot_admit(serve, upstreams):
    server = serve(traffic={"soft_limit": 1, "hard_limit": 2})

    def slow() -> None:
        # Both engines answer slowly: a request that fails over (a first byte late on a loaded machine)
        # is still held open, so the two requests are still in flight when /readyz is asked.
        for u in (upstreams.omni_a, upstreams.omni_b):
            u.default = Script(flavour="omni", text=LONG, chunk_delay_s=0.05)

    upstreams.bg.call(slow)
    async with httpx.AsyncClient(timeout=20) as client:
        assert (await client.get(server.url + "/readyz")).status_code == 200
        held = []
        for _ in range(2):
            req = client.build_request("POST", server.url + "/v1/chat/completions", json=SPEECH)
            held.append(await client.send(req, stream=True))
        assert [r.status_code for r in held] == [200, 200]
        full = await client.get(server.url + "/readyz")
        assert full.status_code == 503
        assert full.json() == {"status": "not_ready", "reason": "admission_full"}
        for r in held:
            await r.aclose()
        assert await eventually(lambda: _held(server)[0] == 0, timeout=10)
        again = await client.get(server.url + "/readyz")
        assert again.status_code == 200 and again.json() == {"status": "ready"}


@pytest.mark.parametrize("name", ["caf€", "x\r\nset-cookie: a=b", "a" * 5000])
async def test_any_dropped_field_name_makes_a_valid_header(serve, name):
    server = serve(requests={"unknown_fields": "drop"})
    body = orjson.dumps({**TEXT, name: 1, "also": 2})
    async with httpx.AsyncClient(timeout=20) as client:
        for stream in (False, True):
            r = await client.post(
                server.url + "/v1/chat/completions",
                content=orjson.dumps({**orjson.loads(body), "stream": stream}),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 200, r.text
            value = r.headers["x-omnigate-dropped-fields"]
            assert value.isascii() and value.isprintable() and len(value) <= 1024
            assert "set-cookie" not in r.headers
            if len(name) < 100:
                assert "also" in value.split(",")
            if "€" in name:
                assert "caf%E2%82%AC" in value.split(",")
    assert await eventually(lambda: _held(server) == (0, {}, 0.0), timeout=10)
