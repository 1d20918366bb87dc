"""The official openai-python realtime client, unmodified, against ``/v1/realtime`` over the scripted
vLLM-Omni: a spoken two-turn conversation (manual commit, then server VAD on real speech), its events parsed
by the SDK's own types, and a barge-in the engine sees as its request closed."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest
from openai import BaseModel
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import RATE, silence, speech, tone
from tests.upstream import Script

pytestmark = pytest.mark.timeout(90)

FIRST = "Hello, how can I help?"
SECOND = "Turning left is right."


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


async def _until(conn, kind: str, seen: list) -> list:
    got = []
    async with asyncio.timeout(20):
        async for event in conn:
            seen.append(event)
            got.append(event)
            if event.type == kind:
                return got
    raise AssertionError(f"the connection ended before {kind}")


def _answer(events: list) -> tuple[bytes, str, object]:
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    words = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    return audio, words, events[-1]


def test_a_spoken_two_turn_conversation_through_the_python_sdk(server, ups, key, tmp_path):
    ups.omni_a.enqueue(Script(flavour="omni", text=FIRST), Script(flavour="omni", text=SECOND))
    said = silence(0.3) + speech(tmp_path) + silence(1.0)

    async def talk() -> tuple:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key.key, max_retries=0)
        seen: list = []
        async with client.realtime.connect(model=OMNI_MODEL) as conn:
            created = (await _until(conn, "session.created", seen))[-1]
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}},
                }
            )
            await _until(conn, "session.updated", seen)
            await conn.input_audio_buffer.append(audio=base64.b64encode(tone(0.6)).decode())
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = await _until(conn, "response.done", seen)
            committed = next(e for e in seen if e.type == "input_audio_buffer.committed")
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            await _until(conn, "conversation.item.retrieved", seen)
            # The second turn: the caller speaks, server VAD hears the turn end and answers by itself.
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
            )
            await _until(conn, "session.updated", seen)
            step = int(0.1 * RATE) * 2
            for at in range(0, len(said), step):
                await conn.input_audio_buffer.append(audio=base64.b64encode(said[at : at + step]).decode())
                await asyncio.sleep(0.02)
            second = await _until(conn, "response.done", seen)
        await client.close()
        return created, first, second, seen

    created, first, second, seen = asyncio.run(talk())
    assert created.session.audio.output.format.rate == 24000
    audio1, words1, done1 = _answer(first)
    audio2, words2, done2 = _answer(second)
    assert (words1, words2) == (FIRST, SECOND)
    assert audio1 and audio2 and done1.response.status == done2.response.status == "completed"
    assert done1.response.usage.output_tokens > 0
    kinds = [e.type for e in second]
    assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.speech_stopped" in kinds
    assert not [e for e in seen if e.type == "error"]
    # Every event is one of the SDK's own types, whole: it validates against its model (required fields,
    # literals), not only constructed from it as the SDK does.
    for e in seen:
        assert isinstance(e, BaseModel), e
        type(e).model_validate(e.model_dump(mode="json", exclude_unset=True))
    second_request = ups.omni_a.requests[-1]["messages"]
    assert [m["role"] for m in second_request] == ["user", "assistant", "user"]
    assert second_request[1]["content"] == FIRST


def test_barge_in_through_the_python_sdk_closes_the_engine_request(server, ups, key, tmp_path):
    ups.omni_a.default = Script(flavour="omni", text=FIRST, audio_chunks=60, chunk_delay_s=0.1)
    said = speech(tmp_path)

    async def talk() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key.key, max_retries=0)
        seen: list = []
        async with client.realtime.connect(model=OMNI_MODEL) as conn:
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
            )
            await _until(conn, "session.updated", seen)
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Go on."}],
                }
            )
            await conn.response.create()
            await _until(conn, "response.output_audio.delta", seen)
            step = int(0.1 * RATE) * 2
            for at in range(0, len(said), step):
                await conn.input_audio_buffer.append(audio=base64.b64encode(said[at : at + step]).decode())
                await asyncio.sleep(0.02)
            done = (await _until(conn, "response.done", seen))[-1]
            played = sum(
                len(base64.b64decode(e.delta)) for e in seen if e.type == "response.output_audio.delta"
            )
            await conn.conversation.item.truncate(
                item_id=done.response.output[0].id,
                content_index=0,
                audio_end_ms=played * 1000 // (2 * RATE) // 2,
            )
            await _until(conn, "conversation.item.truncated", seen)
        await client.close()
        return seen

    seen = asyncio.run(talk())
    done = next(e for e in seen if e.type == "response.done")
    assert done.response.status == "cancelled"
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=5)
