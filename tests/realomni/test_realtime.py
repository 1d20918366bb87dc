"""``/v1/realtime`` against the real vLLM-Omni (its tiny random-weight Qwen3-Omni on the CPU) through the
gateway, with the official realtime clients: a spoken two-turn conversation over chat-backed turns with
openai-python and with openai-node, and with each a barge-in (the client's response.cancel once the engine
has begun the answer) that aborts the engine's request. The words mean nothing (random weights); the events, the audio, the engine's abort and the audit
records are what is asserted."""

from __future__ import annotations

import asyncio
import base64
import time

import openai
import pytest

from tests.http.realtime_helpers import RATE, audit_rows, tone
from tests.realomni.conftest import MODEL

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(1800)]


async def _until(conn, kind: str, seen: list) -> list:
    got = []
    async with asyncio.timeout(600):
        async for event in conn:
            seen.append(event)
            got.append(event)
            assert event.type != "error", event
            if event.type == "response.done" and kind == "response.done":
                # a failed turn says why (status_details), which the assertion on its status shows
                assert event.response.status in ("completed", "cancelled"), event.response.status_details
            if event.type == kind:
                return got
            # Let the caller's task run: buffered events are received without a pause, and an answer's
            # deltas arriving as fast as they are read would starve the audio it sends over them.
            await asyncio.sleep(0)
    raise AssertionError(f"the connection ended before {kind}")


def _audited_turns(db, session_id: str) -> list[int]:
    """The turn indexes of the session's request records in the audit trail, in order."""
    return sorted(
        r["payload"]["realtime"]["turn"]
        for r in audit_rows(db, "request")
        if (r["payload"].get("realtime") or {}).get("session_id") == session_id
    )


def test_a_spoken_two_turn_conversation(omni_gateway):
    async def talk() -> tuple[str, list]:
        client = openai.AsyncOpenAI(base_url=omni_gateway.url + "/v1", api_key="unused", max_retries=0)
        seen: list = []
        async with client.realtime.connect(model=MODEL) as conn:
            created = (await _until(conn, "session.created", seen))[-1]
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
                }
            )
            await _until(conn, "session.updated", seen)
            answers = []
            for hz in (440.0, 660.0):
                await conn.input_audio_buffer.append(audio=base64.b64encode(tone(0.8, hz=hz)).decode())
                await conn.input_audio_buffer.commit()
                await conn.response.create(response={"max_output_tokens": 16})
                answers.append(await _until(conn, "response.done", seen))
        await client.close()
        return created.session.id, answers

    session_id, answers = asyncio.run(talk())
    for events in answers:
        audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
        assert events[-1].response.status == "completed"
        assert len(audio) > RATE // 10 and len(audio) % 2 == 0  # PCM16 at the session's 24 kHz
        assert any(e.type == "response.output_audio_transcript.done" for e in events)
    assert _audited_turns(omni_gateway.db, session_id) == [1, 2]


def test_a_barge_in_aborts_the_engines_request(omni_gateway, omni):
    """The caller speaks over the answer and the client stops it as voice apps do (its own VAD heard the
    caller: response.cancel) once the engine has begun the answer. The answer is cancelled and the
    engine's request aborted (vLLM-Omni logs the abort of the gateway's request). The server's VAD barge-in
    is tested against the scripted engine (tests/http/test_realtime.py): here the tiny model's thinker
    takes both cores, and a caller's paced audio reached the gateway too late to be heard in time."""

    async def talk() -> list:
        client = openai.AsyncOpenAI(base_url=omni_gateway.url + "/v1", api_key="unused", max_retries=0)
        seen: list = []
        async with client.realtime.connect(model=MODEL) as conn:
            await _until(conn, "session.created", seen)
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
                }
            )
            await _until(conn, "session.updated", seen)
            await conn.input_audio_buffer.append(audio=base64.b64encode(tone(0.8)).decode())
            await conn.input_audio_buffer.commit()
            # long enough that the thinker is still writing when the cancel reaches the engine
            await conn.response.create(response={"max_output_tokens": 1536})
            await _until(conn, "response.content_part.added", seen)  # the engine has the request
            await conn.response.cancel()
            done = (await _until(conn, "response.done", seen))[-1]
        await client.close()
        assert done.response.status == "cancelled", done.response.status_details
        return seen

    before = omni.log.stat().st_size
    asyncio.run(talk())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "abort" not in _log_since(omni, before):
        time.sleep(0.5)
    assert "abort" in _log_since(omni, before), omni.tail()


def _log_since(omni, offset: int) -> str:
    with omni.log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").lower()


def _node_realtime(omni_gateway, tmp_path, monkeypatch, job: dict) -> list:
    """openai-node's realtime client (``OpenAIRealtimeWS``), unmodified, behind a TLS terminator as the
    scripted-engine tests have it (the SDK opens ``wss://`` only): the events it saw."""
    from tests.node import sdk
    from tests.node.test_openai_node_realtime import _certificate, _tls_terminator

    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("NODE_EXTRA_CA_CERTS", str(cert))
    tls = omni_gateway.bg.run(_tls_terminator(omni_gateway.port, cert, key))
    url = f"https://127.0.0.1:{tls.sockets[0].getsockname()[1]}/v1"
    try:
        events: list = sdk.call(url, "realtime", {"model": MODEL, **job}, timeout=1200)["events"]
    finally:
        tls.close()
    assert not [e for e in events if e["type"] in ("error", "sdk_error")], events
    return events


def test_a_spoken_two_turn_conversation_through_openai_node(omni_gateway, tmp_path, monkeypatch):
    """openai-node in two spoken turns with the real engine."""
    turns = [base64.b64encode(tone(0.8, hz=hz)).decode() for hz in (440.0, 660.0)]
    events = _node_realtime(omni_gateway, tmp_path, monkeypatch, {"turns": turns, "max_output_tokens": 16})
    done = [e for e in events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["completed", "completed"], done
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    assert len(audio) > 2 * (RATE // 10) and len(audio) % 2 == 0  # PCM16 at the session's 24 kHz
    (created,) = [e for e in events if e["type"] == "session.created"]
    assert _audited_turns(omni_gateway.db, created["session"]["id"]) == [1, 2]


def test_a_barge_in_through_openai_node_aborts_the_engines_request(omni_gateway, omni, tmp_path, monkeypatch):
    """openai-node cancels the first answer once the engine has begun it (its content part announced: a caller
    speaking over it; the tiny model's speech comes whole at the end, too late to cancel at), the engine
    aborts the request, and the conversation goes on to a second, completed turn."""
    turns = [base64.b64encode(tone(0.8, hz=hz)).decode() for hz in (440.0, 660.0)]
    before = omni.log.stat().st_size
    # the first answer long enough that the thinker is still writing when the cancel reaches the engine
    job = {"turns": turns, "max_output_tokens": [1024, 16], "barge_in": {"at": "response.content_part.added"}}
    events = _node_realtime(omni_gateway, tmp_path, monkeypatch, job)
    done = [e for e in events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["cancelled", "completed"], done
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "abort" not in _log_since(omni, before):
        time.sleep(0.5)
    assert "abort" in _log_since(omni, before), omni.tail()
    (created,) = [e for e in events if e["type"] == "session.created"]
    assert _audited_turns(omni_gateway.db, created["session"]["id"]) == [1, 2]
