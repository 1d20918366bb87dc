"""A 45-minute recording: two engine calls in order, one response; the segment plan travels with the request
media-limits returns, and its boundaries reach the audit record."""

from __future__ import annotations

import base64
import io
import sqlite3

import httpx
import orjson
import pytest
import soundfile as sf
from prometheus_client import CollectorRegistry

from core.context import RequestContext
from core.schemas import ChatCompletionRequest
from gateway.pipeline.segments import segment_request
from policies.base import Segmented
from policies.media_limits import MediaLimits, MediaLimitsConfig
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.media import long_flac
from tests.plugins import PLUGINS
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def recording() -> bytes:
    return long_flac(45.0)


def _chain() -> PolicyChainConfig:
    return PolicyChainConfig(
        pre=[
            PolicySpec(name="request-limits"),
            PolicySpec(name="media-fetch"),
            PolicySpec(name="media-limits"),
        ]
    )


@pytest.fixture(scope="module")
def audit_db(tmp_path_factory):
    return tmp_path_factory.mktemp("segments") / "audit.db"


@pytest.fixture(scope="module")
def gw(bg, upstreams, audit_db):
    settings = gateway_settings(upstreams, _chain(), audit={"sqlite_path": str(audit_db)})
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()


def _record(db, rid: str) -> dict:
    """The request's audit payload as the store holds it (written before the response ended)."""
    conn = sqlite3.connect(db)
    try:
        row = conn.execute(
            "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?", (rid,)
        ).fetchone()
    finally:
        conn.close()
    assert row is not None, rid
    return orjson.loads(row[0])["payload"]


def _body(recording: bytes, **extra) -> dict:
    return {
        "model": OMNI_MODEL,
        **extra,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Transcribe this meeting."},
                    {
                        "type": "input_audio",
                        "input_audio": {"data": base64.b64encode(recording).decode(), "format": "flac"},
                    },
                ],
            }
        ],
    }


def _slots_given_back(gw: GatewayServer) -> bool:
    """Every engine slot a segmented request claimed is free again (one slot per request at a time)."""
    slots = gw.services.pool.concurrency
    return wait_until(lambda: all(v["in_flight"] == 0 for v in gw.bg.call(slots).values()))


def _sent_seconds(request: dict) -> float:
    part = request["messages"][0]["content"][1]
    pcm, rate = sf.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="int16")
    assert rate == 16000
    return len(pcm) / rate


def test_45_minute_audio_streams_two_segments_in_order_as_one_response(gw, ups, recording):
    ups.omni_a.enqueue(
        Script(flavour="omni", text="first part said."), Script(flavour="omni", text="second part said.")
    )
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        timeout=120,
        json=_body(recording, stream=True, stream_options={"include_usage": True}),
    ) as resp:
        assert resp.status_code == 200
        assert "audio-split" in resp.headers["x-omnigate-degraded"]
        frames = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [orjson.loads(f) for f in frames[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "first part said.\n\nsecond part said."
    finishes = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finishes == ["stop"]  # one response: the first segment's finish is not released
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage == [{"prompt_tokens": 22, "completion_tokens": 6, "total_tokens": 28}]  # both calls summed
    assert ups.omni_a.request_count == 2
    assert [round(_sent_seconds(r)) for r in ups.omni_a.requests] == [2400, 300]
    assert _slots_given_back(gw)


def test_45_minute_audio_without_streaming_joins_the_answers(gw, ups, recording, audit_db):
    ups.omni_a.enqueue(Script(flavour="omni", text="alpha."), Script(flavour="omni", text="beta."))
    resp = httpx.post(
        gw.url + "/v1/chat/completions",
        json=_body(recording),
        headers={"x-request-id": "seg-json"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "alpha.\n\nbeta."
    assert resp.json()["usage"]["prompt_tokens"] == 22
    assert [round(_sent_seconds(r)) for r in ups.omni_a.requests] == [2400, 300]
    assert _slots_given_back(gw)
    # What the auditor reads: where the input was cut, and the two engine calls it took.
    record = _record(audit_db, "seg-json")
    assert record["segments"] == [[0.0, 2400.0], [2400.0, 2700.0]]
    assert "audio-split" in record["degraded"]


@pytest.mark.parametrize("shadow", [False, True])
def test_a_plugins_plan_is_executed_and_a_shadow_ones_never(bg, upstreams, tmp_path, shadow):
    """Any pre-policy may return a plan with its rewrite. A shadow policy's rewrite is recorded, never
    served: its plan must not be executed either (two engine calls made for a request it did not serve)."""
    chain = PolicyChainConfig(
        pre=[PolicySpec(name="request-limits"), PolicySpec(name="split-text", shadow=shadow)]
    )
    db = tmp_path / "a.db"
    settings = gateway_settings(upstreams, chain, audit={"sqlite_path": str(db)})
    server = GatewayServer(
        bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}
    ).start()
    try:
        upstreams.reset()
        upstreams.omni_a.default = Script(flavour="omni", text="ok.")
        body = {
            "model": OMNI_MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "one|two"}]}],
        }
        resp = httpx.post(
            server.url + "/v1/chat/completions", json=body, headers={"x-request-id": "seg-plugin"}, timeout=60
        )
        assert resp.status_code == 200, resp.text
        sent = [r["messages"][-1]["content"] for r in upstreams.omni_a.requests]
        sent = [c if isinstance(c, str) else "".join(p["text"] for p in c) for c in sent]
        record = _record(db, "seg-plugin")
        runs = [(p["name"], p["verdict"], p["shadow"]) for p in record["policies"]]
        assert ("split-text", "rewrite", shadow) in runs
        if shadow:
            assert sent == ["one|two"]  # the client's request, once
            assert resp.json()["choices"][0]["message"]["content"] == "ok."
            assert "segments" not in record
        else:
            assert sent == ["one", "two"]
            assert resp.json()["choices"][0]["message"]["content"] == "ok. ok."
            assert record["segments"] == [[0.0, 1.0], [1.0, 2.0]]
    finally:
        server.stop()


def test_a_later_segment_fails_over_before_its_first_chunk(gw, ups, recording):
    ups.omni_a.enqueue(
        Script(flavour="omni", text="from primary."), Script(flavour="omni", fault="500_before_headers")
    )
    ups.omni_b.default = Script(flavour="omni", text="from fallback.")
    resp = httpx.post(gw.url + "/v1/chat/completions", json=_body(recording, stream=True), timeout=120)
    assert resp.status_code == 200
    chunks = [orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "from primary.\n\nfrom fallback."
    assert round(_sent_seconds(ups.omni_b.requests[-1])) == 300
    assert _slots_given_back(gw)


async def test_the_segment_plan_is_returned_with_the_rewritten_request(recording):
    policy = MediaLimits(MediaLimitsConfig())
    ctx = RequestContext.new("r")
    request = ChatCompletionRequest.model_validate(_body(recording))
    try:
        out = await policy.pre(request, ctx)
    finally:
        await policy.aclose()
    assert isinstance(out, Segmented)  # data the pipeline executes, nothing left on the context
    first, seg = out.request, out.plan
    assert seg is not None and seg.part == "messages.0.content.1"
    assert seg.boundaries == [(0.0, 2400.0), (2400.0, 2700.0)]
    assert "audio-split" in ctx.outputs.degraded and ctx.outputs.media[0].duration_s == 2700.0
    second = segment_request(first, seg, 1)  # what the pipeline sends as the second segment
    assert _sent_seconds(orjson.loads(second.model_dump_json())) == pytest.approx(300.0)
    assert second.messages[0].content[0] == first.messages[0].content[0]  # the prompt goes with every segment
