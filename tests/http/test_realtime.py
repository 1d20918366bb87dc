"""``WS /v1/realtime`` over the scripted vLLM-Omni: spoken turns, manual commit and server VAD, barge-in and
cancellation (the engine sees its request closed), the session's one admission slot, and the audit trail."""

from __future__ import annotations

import base64
import os
import re
import struct
import subprocess
import sys
import time
import wave
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from websockets.exceptions import InvalidStatus

from gateway.tenants import mint_key
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import RATE, Client, answer, audit_rows, silence, speech, tone
from tests.upstream import Script

pytestmark = pytest.mark.timeout(90)

FIRST = "The first answer is short."
SECOND = "And here is the second one."


@pytest.fixture(scope="module")
def key():
    return mint_key()


@pytest.fixture(scope="module")
def server(bg, upstreams, key, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams,
        tenants=[{"name": "voice", "models": [OMNI_MODEL]}],
        api_keys=[{"id": key.id, "tenant": "voice", "sha256": key.sha256}],
        audit={"sqlite_path": str(db)},
        server={"stream_write_timeout_s": 1.0},  # a client that stops reading is cut after a second
    )
    # The scripted engine makes minutes of speech for the stalled-reader test before its first byte.
    settings.engines[0] = settings.engines[0].model_copy(update={"first_byte_timeout_s": 30.0})
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    s.db = db
    yield s
    s.stop()


@pytest.fixture
def ups(server, upstreams):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    # The previous test's sessions are over on the server's side too (a client's close returns first).
    assert wait_until(lambda: server.services.metrics.realtime_sessions._value.get() == 0, timeout=10)
    return upstreams


def _manual(c: Client) -> None:
    c.send(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"turn_detection": None}},
            },
        }
    )
    c.until("session.updated")


def _in_flight(server) -> int:
    return server.bg.run(server.services.pipeline.admission.store.in_flight())


def _first_audio_count(server) -> float:
    samples = server.services.metrics.first_audio.collect()[0].samples
    return sum(x.value for x in samples if x.name.endswith("_count") and x.labels["engine"] == "omni-int4")


def test_two_spoken_turns_manual_commit(server, ups, key):
    ups.omni_a.enqueue(Script(flavour="omni", text=FIRST), Script(flavour="omni", text=SECOND))
    first_audio_before = _first_audio_count(server)
    with Client(server.url, key.key) as c:
        created = c.until("session.created")[-1]
        assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        _manual(c)
        c.append(tone(0.8))
        c.send({"type": "input_audio_buffer.commit"})
        committed = c.until("input_audio_buffer.committed")[-1]
        c.send({"type": "response.create"})
        audio1, words1, done1 = answer(c.until("response.done"))
        c.append(tone(0.5, hz=660))
        c.send({"type": "input_audio_buffer.commit"})
        c.send({"type": "response.create"})
        events2 = c.until("response.done")
        assert answer(events2)[0]
        _, words2, done2 = answer(events2)
        session_id = created["session"]["id"]
    assert words1 == FIRST and words2 == SECOND
    assert done1["response"]["status"] == done2["response"]["status"] == "completed"
    assert done1["response"]["usage"]["output_tokens"] > 0
    assert len(audio1) > RATE and len(audio1) % 2 == 0  # seconds of PCM16 at the session's rate
    kinds = [e["type"] for e in events2]
    assert (
        kinds.index("response.created")
        < kinds.index("response.output_audio.delta")
        < kinds.index("response.done")
    )
    assert "response.output_audio_transcript.done" in kinds and "rate_limits.updated" in kinds
    # The second turn is the conversation so far: the first user audio, the first answer's words, the new audio.
    body = ups.omni_a.requests[-1]
    assert body["stream"] is True and body["modalities"] == ["text", "audio"]
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == FIRST
    part = body["messages"][0]["content"][0]
    assert part["type"] == "input_audio"
    # the committed turns at the engine's 16 kHz: resampled once each (the session keeps them so), so the media
    # steps pass them on with a header's probe rather than resampling the conversation's audio at every turn
    wavs = [base64.b64decode(m["content"][0]["input_audio"]["data"]) for m in body["messages"][::2]]
    assert [struct.unpack_from("<I", w, 24)[0] for w in wavs] == [16000, 16000]
    assert [round((len(w) - 44) / 32000, 2) for w in wavs] == [0.8, 0.5]
    assert committed["item_id"]

    # One record per turn, marked with the session and its index, and the session's open and close.
    def records() -> bool:
        return (
            len([r for r in audit_rows(server.db, "realtime_session") if r["request_id"] == session_id]) == 2
        )

    assert wait_until(records, timeout=10)
    turns = [
        r["payload"]
        for r in audit_rows(server.db, "request")
        if (r["payload"].get("realtime") or {}).get("session_id") == session_id
    ]
    assert [t["realtime"]["turn"] for t in turns] == [1, 2]
    assert [t["degraded"] for t in turns] == [[], []]  # no part was resampled by the media steps
    assert turns[0]["realtime"]["audio_in"]["seconds"] == pytest.approx(0.8, abs=0.01)
    # the answer's audio and transcript by digest, as for any spoken chat answer (its PCM as the engine spoke it)
    assert turns[0]["output"]["audio_bytes"] > 0 and len(turns[0]["output"]["transcript_sha256"]) == 64
    assert turns[0]["outcome"] in ("served", "degraded") and turns[0]["usage"]["audio_seconds"] > 0
    opened, closed = (
        r["payload"] for r in audit_rows(server.db, "realtime_session") if r["request_id"] == session_id
    )
    assert opened["event"] == "open" and closed["event"] == "close" and closed["turns"] == 2
    assert closed["usage"]["audio_in_seconds"] == pytest.approx(1.3, abs=0.01)
    assert wait_until(lambda: _in_flight(server) == 0, timeout=10)  # released as the session ends
    # Each turn is a chat request: the first-audio histogram (and its P99 300 ms alert) counts it too.
    assert _first_audio_count(server) == first_audio_before + 2
    turn_first_audio = server.services.metrics.realtime_first_audio.collect()[0].samples
    assert next(x.value for x in turn_first_audio if x.name.endswith("_count")) >= 2


def test_server_vad_hears_a_spoken_turn_and_answers(server, ups, key, tmp_path):
    ups.omni_a.default = Script(flavour="omni", text=FIRST)
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}
                    },
                },
            }
        )
        assert (
            c.until("session.updated")[-1]["session"]["audio"]["input"]["turn_detection"]["type"]
            == "server_vad"
        )
        c.append(silence(0.3) + speech(tmp_path) + silence(1.0), pace_s=0.02)
        events = c.until("response.done", timeout=20)
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped")
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed")
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    assert (
        started["item_id"] == stopped["item_id"] and 0 <= started["audio_start_ms"] < stopped["audio_end_ms"]
    )
    audio, words, done = answer(events)
    assert words == FIRST and audio and done["response"]["status"] == "completed"


def test_barge_in_cancels_the_answer_and_closes_the_engine_request(server, ups, key, tmp_path):
    ups.omni_a.default = Script(flavour="omni", text=FIRST, audio_chunks=60, chunk_delay_s=0.1)
    metrics = server.services.metrics
    before = metrics.realtime_barge_ins._value.get()
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
                },
            }
        )
        c.until("session.updated")
        c.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Talk."}],
                },
            }
        )
        c.send({"type": "response.create"})
        c.until("response.output_audio.delta")
        c.append(speech(tmp_path), pace_s=0.02)  # the caller speaks over the answer
        events = c.until("response.done", timeout=20)
        done = events[-1]
        assert done["response"]["status"] == "cancelled"
        assert any(e["type"] == "input_audio_buffer.speech_started" for e in events)
        assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=5)  # the engine saw its request closed
        item_id = done["response"]["output"][0]["id"]
        sent = [e for e in c.seen if e["type"] == "response.output_audio.delta"]
        played_ms = 100
        assert sent
        c.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": played_ms,
            }
        )
        truncated = c.until("conversation.item.truncated")[-1]
        assert truncated["audio_end_ms"] == played_ms
    assert metrics.realtime_barge_ins._value.get() == before + 1
    # the time from the caller's speech start to the answer's stop, measured
    stops = [m for m in metrics.realtime_barge_in_stop.collect()[0].samples if m.name.endswith("_count")]
    assert stops[0].value >= 1
    assert metrics.realtime_cancellations.labels("barge_in")._value.get() >= 1
    assert wait_until(lambda: _in_flight(server) == 0, timeout=5)


def test_response_cancel_aborts_the_engine_request_and_the_next_turn_hears_only_what_played(server, ups, key):
    ups.omni_a.enqueue(
        Script(
            flavour="omni",
            text="one two three four five six seven eight nine ten",
            audio_chunks=60,
            chunk_delay_s=0.1,
        ),
        Script(flavour="omni", text=SECOND),
    )
    with Client(server.url, key.key) as c:
        c.until("session.created")
        _manual(c)
        c.append(tone(0.4))
        c.send({"type": "input_audio_buffer.commit"})
        c.send({"type": "response.create"})
        delta = c.until("response.output_audio.delta")[-1]
        c.send({"type": "response.cancel"})
        done = c.until("response.done")[-1]
        assert done["response"]["status"] == "cancelled"
        assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=5)
        audio_ms = (
            sum(
                len(base64.b64decode(e["delta"]))
                for e in c.seen
                if e["type"] == "response.output_audio.delta"
            )
            * 1000
            // (2 * RATE)
        )
        cut = audio_ms // 2
        c.send(
            {
                "type": "conversation.item.truncate",
                "item_id": delta["item_id"],
                "content_index": 0,
                "audio_end_ms": cut,
            }
        )
        c.until("conversation.item.truncated")
        c.send(
            {
                "type": "conversation.item.truncate",
                "item_id": delta["item_id"],
                "content_index": 0,
                "audio_end_ms": audio_ms + 5000,
            }
        )
        err = c.until("error")[-1]
        assert err["error"]["param"] == "audio_end_ms"
        c.send({"type": "response.create"})
        assert answer(c.until("response.done"))[2]["response"]["status"] == "completed"
    spoken = next(m for m in ups.omni_a.requests[-1]["messages"] if m["role"] == "assistant")["content"]
    full = done["response"]["output"][0]["content"][0]["transcript"]
    assert full.startswith(spoken) and len(spoken) < len(full)  # what was not heard left the context


def test_the_session_holds_one_slot_and_gives_it_back_when_the_client_vanishes(server, ups, key):
    ups.omni_a.default = Script(flavour="omni", text=FIRST, audio_chunks=80, chunk_delay_s=0.1)
    c = Client(server.url, key.key)
    c.until("session.created")
    _manual(c)
    assert _in_flight(server) == 1  # the session's own slot, for its life
    c.append(tone(0.3))
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    c.until("response.output_audio.delta")
    assert _in_flight(server) == 1  # its turn borrows it
    c.ws.socket.close()  # gone mid-answer, without a close frame
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=10)
    assert wait_until(lambda: _in_flight(server) == 0, timeout=10)
    assert wait_until(lambda: server.services.metrics.realtime_sessions._value.get() == 0, timeout=5)


def test_text_only_session_answers_with_text_events(server, ups, key):
    ups.omni_a.default = Script(flavour="omni", text=FIRST)
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "output_modalities": ["text"], "instructions": "Be brief."},
            }
        )
        c.until("session.updated")
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
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == FIRST and not any(e["type"] == "response.output_audio.delta" for e in events)
    body = ups.omni_a.requests[-1]
    assert body["modalities"] == ["text"] and body["messages"][0] == {
        "role": "system",
        "content": "Be brief.",
    }


def test_auth_header_or_browser_subprotocol_and_model_access(server, ups, key):
    with pytest.raises(InvalidStatus) as no_key:
        Client(server.url, None)
    assert no_key.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as other_model:
        Client(server.url, key.key, model=TEXT_MODEL)
    assert other_model.value.response.status_code == 404
    browser = Client(server.url, None, subprotocols=["realtime", f"openai-insecure-api-key.{key.key}"])
    try:
        assert browser.ws.subprotocol == "realtime"
        assert browser.until("session.created")[-1]["session"]["model"] == OMNI_MODEL
    finally:
        browser.close()
    assert wait_until(lambda: _in_flight(server) == 0, timeout=5)


def test_engine_refusal_fails_the_response_not_the_session(server, ups, key):
    ups.omni_a.default = Script(flavour="omni", text=FIRST)
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}},
            }
        )
        c.until("session.updated")
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
        done = c.until("response.done")[-1]
        assert done["response"]["status"] == "failed"
        assert done["response"]["status_details"]["error"]["message"]
        c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"output": {"voice": "Ethan"}}},
            }
        )
        c.until("session.updated")
        c.send({"type": "response.create"})
        assert c.until("response.done")[-1]["response"]["status"] == "completed"
    time.sleep(0)


@pytest.mark.parametrize("engine_rate", [16000, 48000])
def test_the_answer_is_resampled_to_the_session_rate(server, ups, key, engine_rate):
    # Talkers speak at 16, 24, 44.1 or 48 kHz (WIRE.md); the session's audio is 24 kHz PCM16 whatever the engine's.
    ups.omni_a.default = Script(flavour="omni", text=FIRST, sample_rate=engine_rate, audio_chunks=5)
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
        audio, _, done = answer(c.until("response.done"))
    assert done["response"]["status"] == "completed"
    assert len(audio) / (2 * RATE) == pytest.approx(5 * 0.2, abs=0.01)  # five 0.2 s pieces, at 24 kHz


def test_the_docs_client_example_runs_as_written(server, ups, key, tmp_path):
    """docs/realtime.md's Python client, run as a user runs it: the SDK configured from the environment."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "realtime.md").read_text()
    (tmp_path / "talk.py").write_text(re.search(r"```python\n(.*?)```", page, re.DOTALL).group(1))
    with wave.open(str(tmp_path / "question.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(tone(0.5))
    ups.omni_a.default = Script(flavour="omni", text=FIRST)
    env = {**os.environ, "OPENAI_BASE_URL": server.url + "/v1", "OPENAI_API_KEY": key.key}
    done = subprocess.run(
        [sys.executable, "talk.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == FIRST
    with wave.open(str(tmp_path / "answer.wav")) as w:
        assert w.getframerate() == RATE and w.getnframes() > RATE // 2


def _text_item(text: str, item_id: str, **kw) -> dict:
    item = {
        "type": "message",
        "id": item_id,
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    return {"type": "conversation.item.create", "item": item, **kw}


def test_items_created_deleted_and_placed_shape_the_next_turn(server, ups, key):
    ups.omni_a.default = Script(flavour="omni", text=FIRST)
    with Client(server.url, key.key) as c:
        c.until("session.created")
        c.send(_text_item("second", "item_b"))
        assert c.until("conversation.item.done")[-1]["item"]["id"] == "item_b"
        c.send(_text_item("dropped", "item_c"))
        c.until("conversation.item.done")
        c.send({"type": "conversation.item.delete", "item_id": "item_c"})
        assert c.until("conversation.item.deleted")[-1]["item_id"] == "item_c"
        c.send(_text_item("first", "item_a", previous_item_id="root"))
        added = c.until("conversation.item.added")[-1]
        assert added["previous_item_id"] is None
        c.send({"type": "conversation.item.delete", "item_id": "item_c"})
        assert c.until("error")[-1]["error"]["code"] == "item_not_found"
        c.send({"type": "response.create"})
        assert c.until("response.done")[-1]["response"]["status"] == "completed"
    texts = [m["content"][0]["text"] for m in ups.omni_a.requests[-1]["messages"]]
    assert texts == ["first", "second"]


def test_a_client_that_stops_reading_is_cut_and_its_engine_request_closed(server, ups, key):
    # Minutes of speech at ten seconds a second: megabytes of events, more than the sockets' buffers hold.
    ups.omni_a.default = Script(
        flavour="omni", text="Long.", audio_chunks=300, audio_seconds_per_chunk=1.0, chunk_delay_s=0.1
    )
    metrics = server.services.metrics
    c = Client(server.url, key.key, max_queue=1)  # its reader stops taking frames once one waits
    try:
        c.until("session.created")
        c.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Go"}],
                },
            }
        )
        c.send({"type": "response.create"})
        assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=40)  # the engine request was closed
        assert wait_until(lambda: metrics.realtime_closed.labels("stalled")._value.get() >= 1, timeout=10)
        assert wait_until(lambda: _in_flight(server) == 0, timeout=10)
    finally:
        c.ws.socket.close()


def test_a_committed_turn_is_retrieved_with_its_audio(server, ups, key):
    with Client(server.url, key.key) as c:
        c.until("session.created")
        _manual(c)
        c.append(tone(0.3))
        c.send({"type": "input_audio_buffer.commit"})
        item_id = c.until("input_audio_buffer.committed")[-1]["item_id"]
        c.send({"type": "conversation.item.retrieve", "item_id": item_id})
        item = c.until("conversation.item.retrieved")[-1]["item"]
    assert item["id"] == item_id and item["role"] == "user"
    assert base64.b64decode(item["content"][0]["audio"]) == tone(0.3)


def test_an_answer_cancelled_before_it_began_stays_an_item_the_client_can_truncate(server, ups, key):
    """A response cancelled before the engine's first byte: its item was announced (output_item.added,
    response.done's output), so it is in the conversation, empty and incomplete, and a client that truncates
    it at what it played (nothing) or retrieves it is answered, not told there is no such item."""
    ups.omni_a.enqueue(
        Script(flavour="omni", text=FIRST, first_byte_delay_s=3.0), Script(flavour="omni", text=SECOND)
    )
    with Client(server.url, key.key) as c:
        c.until("session.created")
        _manual(c)
        c.append(tone(0.4))
        c.send({"type": "input_audio_buffer.commit"})
        c.send({"type": "response.create"})
        c.until("response.created")
        c.send({"type": "response.cancel"})
        done = c.until("response.done")[-1]
        assert done["response"]["status"] == "cancelled"
        (item,) = done["response"]["output"]
        c.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item["id"],
                "content_index": 0,
                "audio_end_ms": 0,
            }
        )
        c.until("conversation.item.truncated")
        c.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
        retrieved = c.until("conversation.item.retrieved")[-1]["item"]
        assert retrieved["id"] == item["id"] and retrieved["status"] == "incomplete"
        c.send({"type": "response.create"})
        # the next answer (whichever script the engine had left: the cancel may have come before it was asked)
        assert answer(c.until("response.done"))[2]["response"]["status"] == "completed"
    roles = [m["role"] for m in ups.omni_a.requests[-1]["messages"]]
    assert roles == ["user"]  # the empty answer is no message to the engine
