"""Hostile realtime clients cost only their own session: malformed, binary and unknown frames are answered
with ``error`` events, audio faster than real time or past the limits ends the session (1008), one key's
sessions are capped, and a flooding session does not stall another's answer."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from prometheus_client import CollectorRegistry
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gateway.realtime import vad
from gateway.tenants import mint_key
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import Client, answer, b64, tone
from tests.upstream import Script

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def key():
    return mint_key()


@pytest.fixture(scope="module")
def server(bg, upstreams, key, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams,
        # load shedding first, as deployed: above the soft limit a session's answers are text-only
        policies=PolicyChainConfig(pre=[PolicySpec(name="load-shedding"), PolicySpec(name="request-limits")]),
        tenants=[{"name": "voice", "models": [OMNI_MODEL]}],
        api_keys=[{"id": key.id, "tenant": "voice", "sha256": key.sha256}],
        audit={"sqlite_path": str(db)},
        realtime={
            "burst_s": 1.0,
            "max_turn_audio_s": 2.0,
            "max_errors": 4,
            "max_sessions_per_key": 2,
            "max_session_s": 6.0,
            "idle_s": 2.5,
            "max_context_audio_s": 1.0,
        },
    )
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield s
    s.stop()


@pytest.fixture
def ups(server, upstreams):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    # The previous test's sessions are over on the server's side too (a client's close returns first).
    assert wait_until(lambda: server.services.metrics.realtime_sessions._value.get() == 0, timeout=10)
    return upstreams


def _closed_with(c: Client, timeout: float = 10) -> int:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            c.ws.recv(timeout=timeout)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


def _in_flight(server) -> int:
    return server.bg.run(server.services.pipeline.admission.store.in_flight())


def test_malformed_binary_and_unknown_frames_get_errors_and_the_session_goes_on(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.ws.send("{not json")
        assert c.until("error")[-1]["error"]["code"] == "invalid_json"
        c.ws.send(b"\x00\x01binary")
        assert c.until("error")[-1]["error"]["code"] == "invalid_frame"
        c.send({"type": "response.create.now", "event_id": "evt_1"})
        err = c.until("error")[-1]
        assert err["error"]["code"] == "invalid_event" and err["error"]["event_id"] == "evt_1"
        assert set(err) == {"type", "event_id", "error"} and err["event_id"] != "evt_1"
        assert set(err["error"]) == {"type", "code", "message", "param", "event_id"}
        c.send({"type": "session.update", "session": {"type": "realtime"}})
        assert c.until("session.updated")[-1]["type"] == "session.updated"  # still open, still serving


def test_invalid_values_are_named(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send({"type": "input_audio_buffer.append", "audio": "%%% not base64"})
        assert c.until("error")[-1]["error"]["param"] == "audio"
        c.send(
            {
                "type": "session.update",
                "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 11025}}}},
            }
        )
        assert c.until("error")[-1]["error"]["param"] == "session.audio.input.format.rate"
        # A refused update changes nothing of what it carried beside the bad value.
        c.send(
            {
                "type": "session.update",
                "session": {
                    "instructions": "Be terse.",
                    "audio": {"output": {"voice": "Ethan", "format": {"type": "audio/pcm", "rate": 12345}}},
                },
            }
        )
        assert c.until("error")[-1]["error"]["param"] == "session.audio.output.format.rate"
        c.send({"type": "session.update", "session": {}})
        now = c.until("session.updated")[-1]["session"]
        assert now["audio"]["output"]["voice"] is None and now["instructions"] == ""
        c.send({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 10})
        assert c.until("error")[-1]["error"]["code"] == "item_not_found"


def test_repeated_abuse_closes_the_session_with_1008(server, ups, key):
    c = Client(server.url, key.key)
    c.until("session.created")
    for _ in range(4):
        c.ws.send("garbage")
    assert _closed_with(c) == 1008
    c.close()
    assert wait_until(lambda: _in_flight(server) == 0, timeout=5)


def test_audio_faster_than_real_time_is_an_error_then_a_close(server, ups, key):
    c = Client(server.url, key.key)
    c.until("session.created")
    c.send({"type": "input_audio_buffer.append", "audio": b64(tone(1.6))})  # the burst allows 1 s ahead
    err = c.until("error")[-1]
    assert err["error"]["code"] == "input_audio_too_fast"
    assert _closed_with(c) == 1008
    c.close()


def test_a_client_that_never_commits_fills_only_its_own_bounded_buffer(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        c.until("session.updated")
        c.append(tone(2.4), piece_s=0.4, pace_s=0.38)  # at real time, past the 2 s a turn may hold
        err = c.until("error")[-1]
        assert err["error"]["code"] == "input_audio_buffer_full"
        c.send({"type": "input_audio_buffer.clear"})
        c.until("input_audio_buffer.cleared")


def test_one_key_holds_at_most_its_cap_of_sessions(server, ups, key):
    a, b = Client(server.url, key.key), Client(server.url, key.key)
    try:
        a.until("session.created")
        b.until("session.created")
        with pytest.raises(InvalidStatus) as refused:
            Client(server.url, key.key)
        assert refused.value.response.status_code == 429
        assert json.loads(refused.value.response.body)["error"]["code"] == "rate_limit_exceeded"
    finally:
        a.close()
    assert wait_until(lambda: _try_open(server, key), timeout=5)
    b.close()


def _try_open(server, key) -> bool:
    try:
        Client(server.url, key.key).close()
    except InvalidStatus:
        return False
    return True


def test_a_flooding_session_does_not_stall_another_ones_answer(server, ups, key):
    ups.omni_a.default = Script(flavour="omni", text="Still here for you.", chunk_delay_s=0.02)
    good, bad = Client(server.url, key.key), Client(server.url, key.key)
    try:
        good.until("session.created")
        bad.until("session.created")
        good.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}],
                },
            }
        )
        good.send({"type": "response.create"})
        for _ in range(3):
            bad.ws.send("x" * 100_000)
        _, words, done = answer(good.until("response.done", timeout=10))
        assert done["response"]["status"] == "completed" and words == "Still here for you."
    finally:
        good.close()
        bad.close()


def test_the_session_ends_at_its_maximum_duration(server, ups, key):
    c = Client(server.url, key.key)
    c.until("session.created")
    with pytest.raises(ConnectionClosed) as closed:
        for _ in range(15):  # busy, never idle: the session's life is what ends it
            c.send({"type": "input_audio_buffer.clear"})
            c.until("input_audio_buffer.cleared")
            time.sleep(0.9)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    with contextlib.suppress(ConnectionClosed, TimeoutError):  # what came before the close, if unread
        while True:
            c.seen.append(json.loads(c.ws.recv(timeout=1)))
    errors = [e for e in c.seen if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["session_expired"]
    c.close()


def test_an_idle_session_is_closed_and_gives_its_slot_back(server, ups, key):
    c = Client(server.url, key.key)
    c.until("session.created")
    assert c.until("error", timeout=10)[-1]["error"]["code"] == "session_idle"
    assert _closed_with(c) == 1008
    c.close()
    assert wait_until(lambda: _in_flight(server) == 0, timeout=5)


def test_server_vad_without_the_model_is_refused_by_name(server, ups, key, monkeypatch):
    monkeypatch.setattr(vad, "model_path", lambda: None)
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {"audio": {"input": {"turn_detection": {"type": "server_vad"}}}},
            }
        )
        err = c.until("error")[-1]
        assert err["error"]["code"] == "server_vad_unavailable"


def test_above_the_soft_limit_answers_are_text_only(server, ups, key):
    gate = server.services.pipeline.admission
    soft = gate._limits["standard"]
    server.bg.call(lambda: gate._limits.__setitem__("standard", (0, soft[1])))
    try:
        with Client(server.url, key.key) as c:
            c.until("session.created")
            c.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "Hi"}],
                    },
                }
            )
            c.send({"type": "response.create"})
            events = c.until("response.done")
    finally:
        server.bg.call(lambda: gate._limits.__setitem__("standard", soft))
    assert not any(e["type"] == "response.output_audio.delta" for e in events)
    assert ups.omni_a.requests[-1]["modalities"] == ["text"]
    # The response says what it became: text, its words as output_text (not a transcript of no audio).
    done = events[-1]["response"]
    assert done["output_modalities"] == ["text"] and done["output"][0]["content"][0]["type"] == "output_text"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_gateway_not_ready_refuses_the_handshake_as_it_refuses_chat(bg):
    from engines.adapters.settings import EngineConfig
    from gateway.settings import Settings
    from tests.tcpproxy import TCPProxy

    # An engine that takes connections and never answers: its first health probe is still out.
    silent = bg.run(TCPProxy("127.0.0.1", 9).start("blackhole"))
    dead = EngineConfig(
        name="silent",
        kind="vllm-omni",
        base_url=f"http://127.0.0.1:{silent.port}/v1",
        model="m",
        serves=[OMNI_MODEL],
    )
    s = GatewayServer(bg, Settings(engines=[dead], logging={"level": "warning"}), CollectorRegistry())
    s.start(wait_ready=False)
    try:
        with pytest.raises(InvalidStatus) as refused:
            Client(s.url, None)
        assert refused.value.response.status_code == 503
        assert json.loads(refused.value.response.body)["error"]["code"] == "gateway_starting"
    finally:
        s.stop()
        bg.run(silent.stop())


def test_the_context_carries_only_the_newest_audio_within_its_budget(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        c.until("session.updated")
        for hz in (440.0, 660.0):
            c.append(tone(0.8, hz=hz), piece_s=0.2, pace_s=0.19)
            c.send({"type": "input_audio_buffer.commit"})
            c.send({"type": "response.create"})
            assert c.until("response.done")[-1]["response"]["status"] == "completed"
    messages = ups.omni_a.requests[-1]["messages"]
    audio = [
        p
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "input_audio"
    ]
    assert len(audio) == 1  # 0.8 s of the 1 s budget: the first turn's audio left the context
    assert [m["role"] for m in messages] == ["assistant", "user"]  # the answer to it stayed


def test_the_input_rate_changes_only_with_an_empty_buffer(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        # audio of the old rate waits in the buffer: the rate may not change under it
        c.send({"type": "input_audio_buffer.append", "audio": b64(tone(0.2))})
        update = {
            "type": "session.update",
            "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
        }
        c.send(update)
        assert c.until("error")[-1]["error"]["param"] == "session.audio.input.format.rate"
        c.send({"type": "input_audio_buffer.clear"})
        c.until("input_audio_buffer.cleared")
        c.send(update)
        assert c.until("session.updated")[-1]["session"]["audio"]["input"]["format"]["rate"] == 16000
