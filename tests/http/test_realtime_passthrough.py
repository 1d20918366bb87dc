"""``WS /v1/realtime`` on an engine configured ``realtime: passthrough``: the official SDK's realtime client
talks two spoken turns through the gateway to the scripted vLLM-Omni socket in both of its event dialects;
the gateway still keeps the session's input limits and audit trail, and the engine socket closes whatever
ends the session. A cancelled answer's rest never reaches the next turn; an engine gone silent mid-turn fails
the turn and ends the session; passthrough is refused where it cannot keep the config's promises."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from websockets.exceptions import InvalidStatus

from engines.adapters.settings import EngineConfig
from gateway.tenants import mint_key
from policies.registry import available_plugins
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import RATE, Client, audit_rows, tone
from tests.plugins import PLUGINS
from tests.realtime_engine import RealtimeEngine

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def key():
    return mint_key()


@pytest.fixture(scope="module")
def guarded_key():
    return mint_key()


@pytest.fixture(scope="module")
def server(bg, upstreams, key, guarded_key, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = gateway_settings(
        upstreams,
        tenants=[
            {"name": "voice", "models": [OMNI_MODEL]},
            {"name": "guarded", "models": [OMNI_MODEL], "policy_set": "checked"},
        ],
        api_keys=[
            {"id": key.id, "tenant": "voice", "sha256": key.sha256},
            {"id": guarded_key.id, "tenant": "guarded", "sha256": guarded_key.sha256},
        ],
        policy_sets={"checked": {"pre": [], "post": [{"name": "retry-unless-cold"}]}},
        audit={"sqlite_path": str(db)},
        realtime={"max_turn_audio_s": 2.0},
    )
    settings.engines[0] = settings.engines[0].model_copy(
        update={"realtime": "passthrough", "realtime_read_timeout_s": 1.5}
    )
    s = GatewayServer(bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}).start()
    s.db = db
    yield s
    s.stop()


@pytest.fixture
def engine(server, upstreams) -> RealtimeEngine:
    upstreams.reset()
    e = upstreams.omni_a.realtime = RealtimeEngine()
    return e


def _talk(server, key, turns: list[bytes], until_error: bool = False) -> list[list[Any]]:
    """Each turn's events (to response.done, or to an error with ``until_error``) through the SDK's client."""

    async def main() -> list[list[Any]]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=key.key)
        out: list[list[Any]] = []
        async with client.realtime.connect(model=OMNI_MODEL) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}},
                }
            )
            for pcm in turns:
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                got: list[Any] = []
                async for event in conn:
                    got.append(event)
                    if event.type == "response.done" or (until_error and event.type == "error"):
                        break
                out.append(got)
        return out

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("names", ["new", "old"])
def test_two_spoken_turns_through_the_engine_socket(server, engine, key, names):
    engine.names, engine.rate = names, 16000
    turns = _talk(server, key, [tone(0.5), tone(0.7)])
    assert len(turns) == 2
    for got in turns:
        kinds = [e.type for e in got]
        assert kinds[0] == "rate_limits.updated" or "response.created" in kinds
        assert "response.audio.delta" not in kinds and "transcription.delta" not in kinds
        assert kinds[-1] == "response.done" and got[-1].response.status == "completed"
        audio = b"".join(base64.b64decode(e.delta) for e in got if e.type == "response.output_audio.delta")
        # half a second at the engine's 16 kHz, at the session's 24 kHz
        assert abs(len(audio) / 2 - RATE // 2) < RATE // 20
        words = "".join(e.delta for e in got if e.type == "response.output_audio_transcript.delta")
        assert words.strip() == engine.text
    assert wait_until(lambda: engine.closed == 1, timeout=10)  # the client left: the engine socket closed
    seen = engine.sessions[0]
    assert seen[0] == {"type": "session.update", "model": server.services.settings.engines[0].model}
    heard = sum(len(base64.b64decode(e["audio"])) for e in seen if e["type"] == "input_audio_buffer.append")
    assert abs(heard / 2 - 16000 * 1.2) < 16000 * 0.05  # 1.2 s of speech at 16 kHz
    assert [e for e in seen if e["type"] == "input_audio_buffer.commit"] == [
        {"type": "input_audio_buffer.commit", "final": True}
    ] * 2

    def records() -> list[dict[str, Any]]:
        return [r for r in audit_rows(server.db, "realtime_session")]

    assert wait_until(lambda: any(r["payload"].get("event") == "close" for r in records()), timeout=10)
    rows = [r["payload"] for r in records()]
    turn_rows = [r for r in rows if r.get("event") == "turn"]
    assert [r["turn"] for r in turn_rows[-2:]] == [1, 2]
    for r in turn_rows[-2:]:
        assert r["audio_in"]["sha256"] and r["audio_out"]["seconds"] == pytest.approx(0.5, abs=0.05)
        assert r["transcript_sha256"] and r["status"] == "completed"


def test_an_input_limit_still_holds(server, engine, key):
    turns = _talk(server, key, [tone(3.0)], until_error=True)
    errors = [e for e in turns[0] if e.type == "error"]
    assert errors and errors[0].error.code == "input_audio_buffer_full"


def test_the_engine_gone_mid_session_is_an_error_and_a_clean_close(server, engine, key):
    engine.die_after_turns = 1
    turns = _talk(server, key, [tone(0.5), tone(0.5)], until_error=True)
    assert turns[0][-1].response.status == "completed"
    errors = [e for e in turns[1] if e.type == "error"]
    assert errors and errors[0].error.code == "engine_gone"
    assert wait_until(lambda: engine.closed == 1, timeout=10)


def _in_flight(server) -> int:
    return server.bg.run(server.services.pipeline.admission.store.in_flight())


def test_a_cancelled_answer_does_not_reach_the_next_turn(server, engine, key):
    """The engine answers a committed turn to its end whoever stops listening: what it still sends for the
    cancelled turn is read and dropped, and the next turn hears only its own answer."""
    first = " ".join(f"first{i}" for i in range(30))
    engine.texts, engine.pace_s = [first, "Second answer here."], 0.02

    async def main() -> tuple[list[Any], list[Any]]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=key.key)
        async with client.realtime.connect(model=OMNI_MODEL) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}},
                }
            )
            turns: list[list[Any]] = []
            for n, pcm in enumerate((tone(0.5), tone(0.5, hz=660))):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                got: list[Any] = []
                async for event in conn:
                    got.append(event)
                    if n == 0 and event.type == "response.output_audio_transcript.delta":
                        await conn.response.cancel()
                        n = -1  # cancelled once
                    if event.type == "response.done":
                        break
                turns.append(got)
        return turns[0], turns[1]

    cancelled, second = asyncio.run(asyncio.wait_for(main(), 60))
    assert cancelled[-1].response.status == "cancelled"
    assert second[-1].response.status == "completed"
    words = "".join(e.delta for e in second if e.type == "response.output_audio_transcript.delta")
    assert words.strip() == "Second answer here."
    assert engine.opened == 1  # drained on the same socket, not reopened


def test_an_engine_silent_mid_turn_fails_the_turn_and_ends_the_session(server, engine, key):
    engine.silent_after_turns = 0  # the first answer stops after its first word
    turns = _talk(server, key, [tone(0.5)])
    kinds = [e.type for e in turns[0]]
    errors = [e for e in turns[0] if e.type == "error"]
    assert errors and errors[0].error.code == "engine_timeout"
    assert kinds[-1] == "response.done" and turns[0][-1].response.status == "failed"
    assert kinds.index("error") < kinds.index("response.done")
    assert wait_until(lambda: engine.closed == 1, timeout=10)  # the engine socket closed
    assert wait_until(lambda: _in_flight(server) == 0, timeout=10)  # the session's slot went back
    assert wait_until(lambda: server.services.metrics.realtime_sessions._value.get() == 0, timeout=10)

    def turn_rows() -> list[dict[str, Any]]:
        rows = [r["payload"] for r in audit_rows(server.db, "realtime_session")]
        return [r for r in rows if r.get("event") == "turn"]

    assert wait_until(lambda: turn_rows() and turn_rows()[-1]["status"] == "failed", timeout=10)
    assert turn_rows()[-1]["error"]["code"] == "engine_timeout"


@pytest.mark.parametrize("kind", ["vllm", "litellm", "stt"])
def test_passthrough_on_an_engine_not_vllm_omni_is_refused(kind):
    with pytest.raises(ValidationError, match=r"engine 'voice'.*realtime: passthrough.*kind " + kind):
        EngineConfig(
            name="voice",
            kind=kind,
            base_url="http://engine:8000/v1",
            model="m",
            serves=["m"],
            realtime="passthrough",
        )


def test_a_chain_with_output_guards_is_refused_passthrough(server, engine, guarded_key):
    """The engine's answer never passes the chain's stream or post policies: a key whose chain has them is
    refused the session before the upgrade (503, the engine and the guards named), and the engine never hears
    of it."""
    with pytest.raises(InvalidStatus) as refused:
        Client(server.url, guarded_key.key)
    assert refused.value.response.status_code == 503
    error = orjson.loads(refused.value.response.body)["error"]
    assert error["code"] == "passthrough_unguarded"
    assert "'omni-int4'" in error["message"] and "retry-unless-cold" in error["message"]
    assert engine.opened == 0
    assert wait_until(lambda: _in_flight(server) == 0, timeout=10)


def test_a_config_whose_chain_guards_a_passthrough_engines_answers_is_refused_at_load():
    """The same promise, checked where the operator sees it: a chain with output guards that serves a model
    on a passthrough engine refuses the config (the runtime refusal above is for tenants written later)."""
    from gateway.settings import Settings

    engine = {"name": "omni-int4", "kind": "vllm-omni", "base_url": "http://engine:8000/v1", "model": "m",
              "serves": ["omni"], "realtime": "passthrough"}  # fmt: skip
    other = {**engine, "name": "text", "kind": "vllm", "serves": ["text"], "realtime": "chat"}
    guarded = {"pre": [], "post": [{"name": "retry-unless-cold"}]}
    with pytest.raises(
        ValidationError, match=r"engines.omni-int4.realtime: .*policies \(retry-unless-cold\)"
    ):
        Settings(engines=[engine], policies=guarded)
    with pytest.raises(ValidationError, match=r"policy_sets.checked \(retry-unless-cold\)"):
        Settings(engines=[engine], policy_sets={"checked": guarded},
                 tenants=[{"name": "voice", "policy_set": "checked"}])  # fmt: skip
    # Every tenant on a chain without them, or a guarded chain only for models elsewhere: the config loads.
    Settings(engines=[engine], policies=guarded, policy_sets={"plain": {"pre": []}},
             tenants=[{"name": "voice", "policy_set": "plain"}])  # fmt: skip
    Settings(engines=[engine, other], policy_sets={"checked": guarded},
             tenants=[{"name": "reader", "models": ["text"], "policy_set": "checked"}])  # fmt: skip
