"""Admission and load shedding through a real gateway and scripted engines: N streams really open at once,
speech shed above the soft limit, 503/429 with Retry-After above the limits (429: a real tenant's key),
per-engine caps, the audit record of each decision, and every slot given back on every way out
(completion, errors, client disconnects)."""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from core.context import RequestContext
from core.schemas import ChatCompletionRequest
from gateway.settings import Settings
from gateway.tenants import mint_key
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, eventually
from tests.plugins import PLUGINS
from tests.stores import redis_prefix
from tests.upstream import Script

pytestmark = pytest.mark.timeout(90)

LONG = " ".join(["word"] * 200)  # 200 text chunks: a stream stays open until the test closes it
SPEECH = {
    "model": OMNI_MODEL,
    "stream": True,
    "messages": [{"role": "user", "content": "Talk to me."}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "Ethan", "format": "wav"},
}
CHAIN = PolicyChainConfig(pre=[PolicySpec(name="load-shedding"), PolicySpec(name="request-limits")])


def _settings(
    upstreams,
    traffic: dict,
    engines: dict[str, dict] | None = None,
    chain: PolicyChainConfig = CHAIN,
    **extra,
) -> Settings:
    base = gateway_settings(upstreams, chain, traffic=traffic, **extra)
    if engines:
        base = base.model_copy(
            update={"engines": [e.model_copy(update=engines.get(e.name, {})) for e in base.engines]}
        )
    return base


@pytest.fixture
def serve(bg, upstreams, tmp_path):
    servers: list[GatewayServer] = []

    def _make(
        traffic: dict, engines: dict[str, dict] | None = None, chain: PolicyChainConfig = CHAIN, **extra
    ):
        upstreams.reset()
        upstreams.bg.call(
            lambda: setattr(
                upstreams.omni_a, "default", Script(flavour="omni", text=LONG, chunk_delay_s=0.05)
            )
        )
        upstreams.bg.call(
            lambda: setattr(
                upstreams.omni_b, "default", Script(flavour="omni", text=LONG, chunk_delay_s=0.05)
            )
        )
        plugins = {**available_plugins(), **PLUGINS}
        db = tmp_path / f"audit-{len(servers)}.db"
        extra = {"audit": {"sqlite_path": str(db)}, "rate_limits": {"key_prefix": redis_prefix()}, **extra}
        server = GatewayServer(
            bg, _settings(upstreams, traffic, engines, chain, **extra), CollectorRegistry(), plugins=plugins
        ).start()
        server.db = db
        servers.append(server)
        return server

    yield _make
    for s in servers:
        s.stop()


def _metric(server: GatewayServer, name: str, labels: dict | None = None) -> float:
    return server.registry.get_sample_value(name, labels or {}) or 0.0


def _idle(server: GatewayServer) -> bool:
    def check() -> bool:
        svc = server.services
        engines = svc.pool.concurrency().values()
        return (
            svc.admission.store.count == 0
            and all(v["in_flight"] == 0 and v["waiting"] == 0 for v in engines)
            and _metric(server, "omnigate_requests_in_flight") == 0
        )

    return server.bg.call(check)


async def assert_no_leak(server: GatewayServer) -> None:
    assert await eventually(lambda: _idle(server), timeout=10), server.bg.call(
        lambda: (server.services.admission.store.count, server.services.pool.concurrency())
    )


async def _open(
    client: httpx.AsyncClient, server: GatewayServer, body: dict | None = None, headers: dict | None = None
) -> httpx.Response:
    """Send a streamed request and return once its status line is in (after the engine's first chunk)."""
    req = client.build_request(
        "POST", server.url + "/v1/chat/completions", json=body or SPEECH, headers=headers
    )
    return await client.send(req, stream=True)


def _record(server: GatewayServer, rid: str) -> dict | None:
    """The request's audit payload, read from the store through its own connection (what an auditor sees)."""
    db = sqlite3.connect(server.db)
    try:
        # The gateway makes request ids; the id a client sent is kept as client_request_id.
        row = db.execute(
            "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?", (rid,)
        ).fetchone()
    finally:
        db.close()
    return None if row is None else orjson.loads(row[0])["payload"]


def _is_openai_error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status
    err = orjson.loads(resp.content)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


async def test_levels_in_order_serve_shed_refuse(serve, upstreams):
    server = serve({"soft_limit": 2, "hard_limit": 4})
    async with httpx.AsyncClient(timeout=20) as client:
        opened = [await _open(client, server) for _ in range(4)]
        assert [r.status_code for r in opened] == [200] * 4
        assert [r.headers.get("x-omnigate-degraded") for r in opened] == [
            None,
            None,
            "load-text-only",
            "load-text-only",
        ]
        sent = upstreams.omni_a.requests[-4:]
        assert [r["modalities"] for r in sent] == [["text", "audio"]] * 2 + [["text"]] * 2
        assert [("audio" in r, "voice" in r) for r in sent[2:]] == [(False, False)] * 2
        # The text-only ones carry their words in delta.content, not in an audio transcript.
        lines = opened[3].aiter_lines()
        line = await anext(lines)
        while not line.startswith("data: ") or '"content":""' in line:
            line = await anext(lines)
        assert '"content":"word ' in line and '"audio"' not in line

        refused = [await client.post(server.url + "/v1/chat/completions", json=SPEECH) for _ in range(2)]
        for r in refused:
            err = _is_openai_error(r, 503, "overloaded")
            assert err["type"] == "overloaded_error" and r.headers["retry-after"] == "1"
        assert upstreams.omni_a.request_count == 4  # refused requests never reached an engine
        assert server.bg.call(lambda: server.services.admission.store.count) == 4
        for r in opened:
            await r.aclose()
    await assert_no_leak(server)
    assert await eventually(lambda: upstreams.omni_a.aborts == 4)

    def m(result):
        return _metric(server, "omnigate_admission_total", {"priority": "standard", "result": result})

    assert (m("admitted"), m("above_soft_limit"), m("refused_overload")) == (2, 2, 2)
    assert _metric(server, "omnigate_degradations_total", {"reason": "load-text-only"}) == 2
    # Admission decides before the body is read (issue 15), so a refused request's model is not known.
    assert _metric(server, "omnigate_requests_total", {"model": "unknown", "outcome": "refused"}) == 2

    def shed(reason):
        return _metric(server, "omnigate_admission_shed_total", {"reason": reason})

    assert (shed("text_only"), shed("overload"), shed("tenant_quota"), shed("engine_busy")) == (2, 2, 0, 0)


async def test_many_streams_at_once_split_exactly_at_the_limits(serve, upstreams):
    server = serve({"soft_limit": 3, "hard_limit": 6})
    async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=20)) as client:
        got = await asyncio.gather(*(_open(client, server) for _ in range(10)))
        ok = [r for r in got if r.status_code == 200]
        refused = [r for r in got if r.status_code == 503]
        assert (len(ok), len(refused)) == (6, 4)
        assert (
            sorted(r.headers.get("x-omnigate-degraded", "") for r in ok) == [""] * 3 + ["load-text-only"] * 3
        )
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert upstreams.omni_a.in_flight == 6
        for r in got:
            await r.aclose()
    await assert_no_leak(server)


async def test_no_slot_leaks_on_any_way_out(serve, upstreams):
    server = serve({"soft_limit": 2, "hard_limit": 4})
    url = server.url + "/v1/chat/completions"
    short = Script(flavour="omni", text="Short answer.", audio_chunks=2)
    async with httpx.AsyncClient(timeout=20) as client:
        # Completion, streamed and not.
        upstreams.omni_a.enqueue(short, short)
        r = await client.post(url, json=SPEECH)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        r = await client.post(url, json={**SPEECH, "stream": False})
        assert r.status_code == 200
        await assert_no_leak(server)

        # The upstream fails mid-stream: error frame, then [DONE].
        upstreams.omni_a.enqueue(Script(flavour="omni", fault="reset_mid_stream", fault_after_chunks=2))
        r = await client.post(url, json=SPEECH)
        assert r.status_code == 200 and '"code":"engine_unavailable"' in r.text
        await assert_no_leak(server)

        # Every engine fails before the first byte, streamed and not.
        for _ in range(2):
            upstreams.omni_a.enqueue(Script(flavour="omni", fault="500_before_headers"))
            upstreams.omni_b.enqueue(Script(flavour="omni", fault="500_before_headers"))
        _is_openai_error(await client.post(url, json=SPEECH), 502, "engine_error")
        _is_openai_error(await client.post(url, json={**SPEECH, "stream": False}), 502, "engine_error")
        await assert_no_leak(server)

        # A pre-policy refuses after admission.
        too_many = {**SPEECH, "messages": [{"role": "user", "content": "x"}] * 300}
        _is_openai_error(await client.post(url, json=too_many), 400, None)
        await assert_no_leak(server)

        # The client leaves mid-stream, and before the first byte.
        r = await _open(client, server)
        await anext(r.aiter_lines())
        await r.aclose()
        await assert_no_leak(server)
        slow = Script(flavour="omni", first_byte_delay_s=0.8, text=LONG, chunk_delay_s=0.05)
        upstreams.omni_a.enqueue(slow)
        before = upstreams.omni_a.request_count
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json=SPEECH, timeout=0.2)
        # the request reached the engine before the client left; whether the gateway has noticed the
        # disconnect yet when the client's timeout fires is a race, so only the end state is asserted
        assert upstreams.omni_a.request_count == before + 1
        await assert_no_leak(server)
    assert _metric(server, "omnigate_requests_total", {"model": OMNI_MODEL, "outcome": "cancelled"}) == 2


async def test_post_policy_retries_give_back_every_attempts_slot(serve, upstreams):
    chain = PolicyChainConfig(
        pre=[PolicySpec(name="load-shedding")],
        stream=[PolicySpec(name="hold-all")],
        post=[PolicySpec(name="retry-unless-cold")],
    )
    server = serve({"soft_limit": 2, "hard_limit": 4}, chain=chain)
    short = Script(flavour="omni", text="Short answer.", audio_chunks=1)
    upstreams.omni_a.enqueue(short, short, short, short)
    async with httpx.AsyncClient(timeout=20) as client:
        for stream in (True, False):
            r = await client.post(
                server.url + "/v1/chat/completions", json={**SPEECH, "stream": stream, "temperature": 0.5}
            )
            assert r.status_code == 200
    assert upstreams.omni_a.request_count == 4  # each was retried once
    assert _metric(server, "omnigate_retries_total", {"policy": "retry-unless-cold"}) == 2
    await assert_no_leak(server)


async def test_priority_header_classes(serve, upstreams):
    server = serve({"soft_limit": 2, "hard_limit": 4})  # batch: soft 1, hard 3
    batch = {"x-omnigate-priority": "batch"}
    async with httpx.AsyncClient(timeout=20) as client:

        def count():
            return server.bg.call(lambda: server.services.admission.store.count)

        def shed(r):
            return r.headers.get("x-omnigate-degraded") == "load-text-only"

        first = await _open(client, server)
        assert not shed(first)
        b1 = await _open(client, server, headers=batch)
        assert shed(b1)  # at one in flight, batch is shed ...
        await b1.aclose()
        assert await eventually(lambda: count() == 1)
        s2 = await _open(client, server)
        assert not shed(s2)  # ... and standard is not
        b2 = await _open(client, server, headers=batch)
        assert shed(b2) and b2.status_code == 200
        refused = await client.post(server.url + "/v1/chat/completions", json=SPEECH, headers=batch)
        _is_openai_error(refused, 503, "overloaded")  # batch stops at 3 ...
        s3 = await _open(client, server)
        assert s3.status_code == 200 and shed(s3)  # ... standard gets the 4th slot
        bad = await client.post(
            server.url + "/v1/chat/completions", json=SPEECH, headers={"x-omnigate-priority": "vip"}
        )
        assert _is_openai_error(bad, 400, "invalid_priority")["type"] == "invalid_request_error"
        higher = await client.post(
            server.url + "/v1/chat/completions", json=SPEECH, headers={"x-omnigate-priority": "interactive"}
        )
        _is_openai_error(higher, 403, "permission_denied")
        for r in (first, s2, b2, s3):
            await r.aclose()
    await assert_no_leak(server)


async def test_tenant_quota_429_over_http_with_a_real_key_and_the_header_only_lowers(serve, upstreams):
    keys = {name: mint_key() for name in ("acme", "globex")}
    server = serve(
        {"soft_limit": 8, "hard_limit": 16},
        tenants=[{"name": "acme", "priority": "interactive", "max_concurrency": 2}, {"name": "globex"}],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
    )
    acme = {"authorization": f"Bearer {keys['acme'].key}"}
    globex = {"authorization": f"Bearer {keys['globex'].key}"}
    url = server.url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=20) as client:
        held = [await _open(client, server, headers=acme) for _ in range(2)]
        assert [r.status_code for r in held] == [200, 200]
        refused = await client.post(url, json=SPEECH, headers={**acme, "x-request-id": "over-quota"})
        err = _is_openai_error(refused, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_error" and refused.headers["retry-after"] == "1"
        assert "quota 2" in err["message"]
        # Another tenant is not held back by acme's quota.
        other = await _open(client, server, headers=globex)
        assert other.status_code == 200
        # acme runs as interactive; its key may ask for a lower class, a standard tenant not for a higher one.
        await held[0].aclose()
        assert await eventually(lambda: server.bg.call(lambda: server.services.admission.store.count) == 2)
        upstreams.omni_a.enqueue(Script(flavour="omni", text="Short answer."))
        lowered = await client.post(
            url,
            json={**SPEECH, "stream": False},
            headers={**acme, "x-omnigate-priority": "batch", "x-request-id": "lowered"},
        )
        assert lowered.status_code == 200
        raised = await client.post(url, json=SPEECH, headers={**globex, "x-omnigate-priority": "interactive"})
        _is_openai_error(raised, 403, "permission_denied")
        for r in (*held[1:], other):
            await r.aclose()
    await assert_no_leak(server)
    assert upstreams.omni_a.request_count + upstreams.omni_b.request_count == 4  # refusals never reached one
    assert _metric(server, "omnigate_admission_shed_total", {"reason": "tenant_quota"}) == 1
    labels = {"priority": "interactive", "result": "refused_quota"}
    assert _metric(server, "omnigate_admission_total", labels) == 1
    record = _record(server, "over-quota")
    assert (record["outcome"], record["status"], record["priority"]) == ("refused", 429, "interactive")
    assert record["control"]["admission"] == {
        "result": "refused_quota",
        "priority": "interactive",
        "in_flight": 2,
        "soft_limit": 16,
        "hard_limit": 16,
        "tenant_in_flight": 2,
        "tenant_quota": 2,
        "store": "local",
        "overloaded": False,
    }
    assert _record(server, "lowered")["control"]["admission"]["priority"] == "batch"


async def test_a_shed_requests_audit_record_says_so(serve, upstreams):
    server = serve({"soft_limit": 0, "hard_limit": 4})
    upstreams.omni_a.enqueue(Script(flavour="omni", text="Text only."))
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(
            server.url + "/v1/chat/completions", json=SPEECH, headers={"x-request-id": "shed-1"}
        )
        assert r.status_code == 200 and r.headers["x-omnigate-degraded"] == "load-text-only"
    record = _record(server, "shed-1")
    assert record["outcome"] == "degraded" and record["degraded"] == ["load-text-only"]
    assert record["control"] == {
        "admission": {
            "result": "above_soft_limit",
            "priority": "standard",
            "in_flight": 0,
            "soft_limit": 0,
            "hard_limit": 4,
            "tenant_in_flight": None,
            "tenant_quota": None,
            "store": "local",
            "overloaded": False,
        },
        "shedding": {"action": "text-only", "reason": "load-text-only"},
    }
    assert [(p["name"], p["verdict"]) for p in record["policies"]][:1] == [("load-shedding", "rewrite")]
    assert _metric(server, "omnigate_admission_shed_total", {"reason": "text_only"}) == 1
    await assert_no_leak(server)


async def test_per_engine_limits_spill_over_then_queue_then_refuse(serve, upstreams):
    server = serve(
        {"soft_limit": 16, "hard_limit": 64},
        engines={
            "omni-int4": {"max_in_flight": 2, "max_waiting": 1},
            "omni-bf16": {"max_in_flight": 1, "max_waiting": 1},
        },
    )
    async with httpx.AsyncClient(timeout=20) as client:
        opened = [await _open(client, server) for _ in range(3)]
        assert (upstreams.omni_a.in_flight, upstreams.omni_b.in_flight) == (2, 1)  # the third spilled over
        waiting = asyncio.create_task(_open(client, server))
        assert await eventually(
            lambda: server.bg.call(lambda: server.services.pool.concurrency()["omni-int4"]["waiting"]) == 1
        )
        busy = await client.post(server.url + "/v1/chat/completions", json=SPEECH)
        _is_openai_error(busy, 503, "engine_busy")
        assert busy.headers["retry-after"] == "1"
        assert not waiting.done()
        await opened[0].aclose()  # a slot frees on omni-int4: the waiter gets it
        fourth = await asyncio.wait_for(waiting, 10)
        assert fourth.status_code == 200
        assert upstreams.omni_a.request_count == 3
        for r in (*opened[1:], fourth):
            await r.aclose()
    await assert_no_leak(server)
    assert _metric(server, "omnigate_admission_shed_total", {"reason": "engine_busy"}) == 1


async def test_overload_lowers_engine_limits_and_recovery_restores_them(serve, upstreams):
    server = serve(
        {"soft_limit": 2, "hard_limit": 8, "overload_exit_below": 1, "monitor_interval_s": 0.05},
        engines={"omni-int4": {"max_in_flight": 4, "max_in_flight_overloaded": 3}},
    )

    def limit():
        return _metric(server, "omnigate_engine_concurrency_limit", {"engine": "omni-int4"})

    assert limit() == 4
    async with httpx.AsyncClient(timeout=20) as client:
        opened = [await _open(client, server) for _ in range(3)]
        assert await eventually(lambda: _metric(server, "omnigate_overloaded") == 1)
        assert limit() == 3
        assert _metric(server, "omnigate_admission_in_flight") == 3
        spilled = await _open(
            client, server
        )  # omni-int4 is at its overload limit: the next goes to omni-bf16
        assert upstreams.omni_b.in_flight == 1
        for r in (*opened, spilled):
            await r.aclose()
    assert await eventually(lambda: _metric(server, "omnigate_overloaded") == 0)
    assert limit() == 4
    await assert_no_leak(server)


async def test_shadow_shedding_records_but_serves_speech(serve, upstreams):
    chain = PolicyChainConfig(
        pre=[PolicySpec(name="load-shedding", shadow=True), PolicySpec(name="request-limits")]
    )
    server = serve({"soft_limit": 0, "hard_limit": 4}, chain=chain)
    upstreams.omni_a.enqueue(Script(flavour="omni", text="Kept speech.", audio_chunks=1))
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(
            server.url + "/v1/chat/completions", json=SPEECH, headers={"x-request-id": "shadow"}
        )
    assert r.status_code == 200 and "x-omnigate-degraded" not in r.headers
    record = _record(server, "shadow")
    assert record["degraded"] == [] and "shedding" not in record["control"]
    assert record["control"]["admission"]["result"] == "above_soft_limit"
    assert _metric(server, "omnigate_admission_shed_total", {"reason": "text_only"}) == 0
    assert '"audio":{"id"' in r.text and '"data":' in r.text
    assert upstreams.omni_a.requests[-1]["modalities"] == ["text", "audio"]
    assert (
        _metric(
            server,
            "omnigate_policy_decisions_total",
            {"policy": "load-shedding", "stage": "pre", "verdict": "rewrite", "shadow": "true"},
        )
        == 1
    )
    await assert_no_leak(server)


async def test_text_requests_are_not_shed_and_traffic_can_be_off(serve, upstreams):
    server = serve({"soft_limit": 0, "hard_limit": 2})
    text = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(server.url + "/v1/chat/completions", json=text)
        assert r.status_code == 200 and "x-omnigate-degraded" not in r.headers
    off = serve({"enabled": False})
    assert off.services.admission is None
    async with httpx.AsyncClient(timeout=20) as client:
        opened = [await _open(client, off) for _ in range(3)]
        assert all(r.status_code == 200 and "x-omnigate-degraded" not in r.headers for r in opened)
        for r in opened:
            await r.aclose()


async def test_a_committed_stream_closed_without_being_read_gives_everything_back(serve, upstreams):
    server = serve({"soft_limit": 2, "hard_limit": 4})
    pipeline = server.services.pipeline
    request = ChatCompletionRequest.model_validate(SPEECH)

    async def run():
        never_iterated = await pipeline.stream(request, RequestContext.new("a"))
        created_not_started = await pipeline.stream(request, RequestContext.new("b"))
        created_not_started.deltas()
        half_read = await pipeline.stream(request, RequestContext.new("c"))
        deltas = half_read.deltas()
        await anext(deltas)
        assert server.services.admission.store.count == 3
        for s in (never_iterated, created_not_started, half_read):
            await s.aclose()
            await s.aclose()  # twice: still released once
        return [s.ctx.record.outcome for s in (never_iterated, created_not_started, half_read)]

    assert server.bg.run(run()) == ["cancelled"] * 3
    await assert_no_leak(server)
    assert await eventually(lambda: upstreams.omni_a.aborts == 3)
