"""``/v1/realtime`` against the real vLLM-Omni (its tiny random-weight Qwen3-Omni on the CPU) through the
gateway, with the official openai-python realtime client: a spoken two-turn conversation over chat-backed
turns. The words mean nothing (random
weights); the events, the audio and the audit records are what is asserted."""

from __future__ import annotations

import asyncio
import base64
import sqlite3

import openai
import orjson
import pytest

from tests.http.realtime_helpers import RATE, tone
from tests.realomni.conftest import MODEL

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(1800)]


async def _until(conn, kind: str, seen: list) -> list:
    got = []
    async with asyncio.timeout(600):
        async for event in conn:
            seen.append(event)
            got.append(event)
            assert event.type != "error", event
            if event.type == kind:
                return got
    raise AssertionError(f"the connection ended before {kind}")


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
    db = sqlite3.connect(omni_gateway.db)
    try:
        rows = [orjson.loads(r[0]) for r in db.execute("SELECT data FROM audit_log WHERE kind = 'request'")]
    finally:
        db.close()
    turns = [
        r["payload"]["realtime"]["turn"]
        for r in rows
        if (r["payload"].get("realtime") or {}).get("session_id") == session_id
    ]
    assert sorted(turns) == [1, 2]
