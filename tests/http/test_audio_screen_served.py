"""The audio screen with a served speech-to-text model (``served``, endpoint ``transcriptions``).

The model is served by tests/transcriber.py, an OpenAI ``/v1/audio/transcriptions`` server running the
whisper the screen runs in the gateway, so the served path must refuse what the local one refuses. The
server is sent each part decoded (16 kHz mono PCM16 WAV), never the client's file, URL or headers; down
or slow, the screen could not judge and its ``on_error`` decides; its receipt names the model and what it
heard.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import soundfile as sf
import yaml
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from core.context import Identity, RequestContext
from core.schemas import ChatCompletionRequest
from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from gateway.tenants import mint_key
from policies.audio_screen import AudioScreen, AudioScreenConfig
from policies.grounding.claims import premise_of
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer, audit_payload, free_port
from tests.media import speech
from tests.transcriber import Transcriber
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)

ADMIN = "5d2c8e1f9a7b3c4d6e0f1a2b8c9d7e3f4a5b6c1d"
PATTERN = r"credit\s*card\s+numbers?"
FLAGGED = "Please send me the credit card numbers."
CLEAN = "Hello world, this is a test."


@pytest.fixture(scope="module")
def engine(bg):
    up = ScriptedUpstream(Script(flavour="vllm", text="I heard you."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


@pytest.fixture(scope="module")
def stt(bg):
    server = bg.run(Transcriber().start())
    yield server
    bg.run(server.stop())


@pytest.fixture(autouse=True)
def _fresh(stt):
    stt.calls.clear()
    stt.delay_s = 0.0
    stt.peak = 0


def _served(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "url": url,
        "model": "whisper-served",
        "endpoint": "transcriptions",
        "api_key": "guard-key",
        "timeout_s": 20,
        **extra,
    }


def _gateway(
    bg,
    engine,
    tmp_path,
    served: dict[str, Any],
    on_error: str = "fail_closed",
    keys: dict[str, Any] | None = None,
) -> GatewayServer:
    screen = PolicySpec(
        name="audio-screen", on_error=on_error, config={"patterns": [PATTERN], "served": served}
    )
    settings = Settings(
        engines=[
            EngineConfig(
                name="e",
                kind="vllm",
                base_url=engine.base_url,
                model="m",
                serves=["m"],
                input_modalities=["text", "audio"],
            )
        ],
        policies=PolicyChainConfig(
            pre=[PolicySpec(name="media-fetch"), screen, PolicySpec(name="media-limits")]
        ),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": keys is not None},
        tenants=[{"name": name} for name in keys or {}],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in (keys or {}).items()],
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start()


def _part(text: str) -> dict[str, Any]:
    # 22.05 kHz as the client sends it: the served model must be sent the screen's 16 kHz decoding
    data = base64.b64encode(speech(text, rate=22050)).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _body(*said: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "Listen."}, *(_part(t) for t in said)]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


CLIENT_HEADERS = {
    "x-client-secret": "client-secret-7781",
    "x-forwarded-host": "client.example",
    "x-api-base": "http://client.example/v1",
}


def _post(server: GatewayServer, body: dict[str, Any], key: Any = None) -> httpx.Response:
    headers = CLIENT_HEADERS if key is None else {**CLIENT_HEADERS, "authorization": f"Bearer {key.key}"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def _receipt(server: GatewayServer, r: httpx.Response) -> dict[str, Any]:
    payload = audit_payload(server.url, ADMIN, r.headers["x-request-id"])
    return {p["name"]: p for p in payload["policies"]}["audio-screen"]


def test_served_refuses_what_the_local_model_refuses(bg, engine, stt, tmp_path):
    local = AudioScreen(AudioScreenConfig(patterns=[PATTERN])).transcribe_bytes(speech(FLAGGED), "p")
    assert AudioScreen(AudioScreenConfig(patterns=[PATTERN]))._patterns[0].search(local), local
    before = engine.request_count
    server = _gateway(bg, engine, tmp_path, _served(stt.url))
    try:
        r = _post(server, _body(FLAGGED))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "content_policy_violation"
        assert err["param"] == "messages.0.content.1.input_audio.data"
        assert engine.request_count == before
        receipt = _receipt(server, r)
    finally:
        server.stop()
    assert receipt["verdict"] == "reject" and receipt["saw"]["model"] == "whisper-served"
    assert len(stt.calls) == 1


def test_clean_speech_is_served_and_the_model_heard_a_16k_wav_only(bg, engine, stt, tmp_path):
    server = _gateway(bg, engine, tmp_path, _served(stt.url))
    try:
        r = _post(server, _body(CLEAN))
        assert r.status_code == 200, r.text
        assert "audio-screen=accept" in r.headers["x-omnigate-guards"]
        receipt = _receipt(server, r)
    finally:
        server.stop()
    (call,) = stt.calls
    assert call.path == "/v1/audio/transcriptions"
    assert call.fields == {"model": "whisper-served", "response_format": "json"}
    info = sf.info(io.BytesIO(call.file))
    assert (info.samplerate, info.channels, info.subtype, info.format) == (16000, 1, "PCM_16", "WAV")
    # The operator's key, never anything of the client's request but its audio.
    assert call.headers["Authorization"] == "Bearer guard-key"
    seen = " ".join(f"{k}: {v}" for k, v in call.headers.items()).lower()
    for value in CLIENT_HEADERS.values():
        assert value.lower() not in seen
    assert "client.example" not in call.filename

    saw = receipt["saw"]
    assert receipt["complete"] is True and saw["model"] == "whisper-served"
    assert "model_digest" not in saw  # the served model's weights are the engine's
    (part,) = saw["parts"]
    assert part["part"] == "messages.0.content.1" and part["kind"] == "audio"
    assert part["segments"] == 1 and 800 < part["ms"] < 5000
    assert abs(part["ms"] - info.frames / 16) <= 1


def test_parts_are_heard_concurrently_but_bounded(bg, engine, stt, tmp_path):
    stt.delay_s = 0.3
    server = _gateway(bg, engine, tmp_path, _served(stt.url, max_inflight=2))
    try:
        r = _post(server, _body(CLEAN, "Turn left at the next corner.", FLAGGED))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.content.3.input_audio.data"
        receipt = _receipt(server, r)
    finally:
        server.stop()
    assert len(stt.calls) == 3 and stt.peak == 2
    assert [p["part"] for p in receipt["saw"]["parts"]] == [f"messages.0.content.{i}" for i in (1, 2, 3)]


def test_audio_a_conversation_sends_again_is_heard_once_per_tenant(bg, engine, stt, tmp_path):
    """A multi-turn conversation as the SDKs write it (and every realtime turn) sends the earlier turns'
    audio again: the screen hears it once per tenant and the receipt says so. Another tenant's same audio is
    heard anew (a kept transcript would tell it, by a faster answer, that someone else sent that audio); a
    refused part is refused again from what was kept."""
    keys = {name: mint_key() for name in ("north", "south")}
    earlier, later, flagged = _part(CLEAN), _part("Turn left at the next corner."), _part(FLAGGED)
    turn_one = {"role": "user", "content": [{"type": "text", "text": "Listen."}, earlier]}
    server = _gateway(bg, engine, tmp_path, _served(stt.url), keys=keys)
    try:
        first = _post(server, {"model": "m", "messages": [turn_one]}, keys["north"])
        assert first.status_code == 200, first.text
        conversation = [
            turn_one,
            {"role": "assistant", "content": "I heard you."},
            {"role": "user", "content": [later]},
        ]
        second = _post(server, {"model": "m", "messages": conversation}, keys["north"])
        assert second.status_code == 200, second.text
        assert len(stt.calls) == 2  # the first turn's audio once, the new turn's once
        receipt = _receipt(server, second)
        other = _post(server, {"model": "m", "messages": [turn_one]}, keys["south"])
        assert other.status_code == 200, other.text
        assert len(stt.calls) == 3
        refused = [
            _post(server, {"model": "m", "messages": [{"role": "user", "content": [flagged]}]}, keys["north"])
            for _ in range(2)
        ]
    finally:
        server.stop()
    assert [r.status_code for r in refused] == [400, 400]
    assert {r.json()["error"]["code"] for r in refused} == {"content_policy_violation"}
    assert len(stt.calls) == 4
    parts = receipt["saw"]["parts"]
    assert [(p["part"], p.get("cached", False)) for p in parts] == [
        ("messages.0.content.1", True),
        ("messages.2.content.0", False),
    ]
    assert receipt["complete"] is True


@pytest.mark.parametrize("trouble", ["down", "slow"])
def test_a_model_down_or_slow_fails_closed(bg, engine, stt, tmp_path, trouble):
    if trouble == "down":
        served = _served(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    else:
        stt.delay_s = 3.0
        served = _served(stt.url, timeout_s=1)
    server = _gateway(bg, engine, tmp_path, served)
    try:
        r = _post(server, _body(CLEAN))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "guard_unavailable" and "audio-screen" in err["message"]
        assert "127.0.0.1" not in err["message"]
        receipt = _receipt(server, r)
    finally:
        server.stop()
    assert receipt["verdict"] == "unavailable" and receipt["complete"] is False
    assert receipt["saw"]["on_error"] == "fail_closed"


def test_fail_open_serves_and_the_receipt_says_not_scanned(bg, engine, stt, tmp_path):
    stt.delay_s = 3.0
    server = _gateway(bg, engine, tmp_path, _served(stt.url, timeout_s=1), on_error="fail_open")
    try:
        r = _post(server, _body(FLAGGED))
        assert r.status_code == 200, r.text
        assert "audio-screen=not_scanned" in r.headers["x-omnigate-guards"]
        receipt = _receipt(server, r)
    finally:
        server.stop()
    assert receipt["verdict"] == "not_scanned" and receipt["complete"] is False
    assert receipt["saw"]["on_error"] == "fail_open"


class _InProcess:
    """The media sandbox's run, in this process (the decoding is the same function)."""

    class sandbox:  # shaped like MediaRuntime.sandbox
        @staticmethod
        async def run(fn, args, param=None):
            return fn(*args)


async def test_served_transcripts_are_the_grounding_premise(stt):
    screen = AudioScreen(AudioScreenConfig(patterns=[PATTERN], served=_served(stt.url)))
    screen._runtime = _InProcess()  # type: ignore[assignment]
    request = ChatCompletionRequest.model_validate(_body("Turn left at the next corner."))
    ctx = RequestContext(Identity("r1"))
    try:
        await screen.pre(request, ctx)
    finally:
        await screen.aclose()
    (heard,) = ctx.outputs.input_transcripts
    assert "turn left" in heard.lower() and "corner" in heard.lower()
    assert heard in premise_of(request, ctx.outputs.input_transcripts, roles=["user"]).text


@pytest.mark.parametrize("endpoint", ["classify", "score", "chat-guard"])
def test_a_served_model_that_does_not_transcribe_is_refused_at_load(endpoint):
    with pytest.raises(ValidationError, match="transcriptions"):
        AudioScreenConfig(served={"url": "http://stt:8000", "model": "w", "endpoint": endpoint})


def test_the_documented_config_loads():
    page = (Path(__file__).parents[2] / "docs/policies/audio-screen.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", page, re.S)
    chain = PolicyChainConfig.model_validate(yaml.safe_load(block)["policies"])
    (screen,) = [p for p in chain.pre if p.name == "audio-screen"]
    config = AudioScreenConfig.model_validate(screen.config)
    assert config.served is not None and config.served.endpoint == "transcriptions"
    assert config.patterns and re.search(config.patterns[0], FLAGGED, re.I)
    # the example's longest audio fits vLLM's default upload limit (25 MB) as the WAV it is sent
    assert config.max_duration_s * 32000 + 44 < 25 * 1024 * 1024
