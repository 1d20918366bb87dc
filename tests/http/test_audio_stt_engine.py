"""``/v1/audio/transcriptions`` for a model on a speech-to-text engine (kind ``stt``: vLLM serving Whisper),
driven by the official OpenAI SDK over real sockets against the scripted upstream's multipart endpoint.

The engine is configured as docs/audio.md shows it. The audio reaches the engine as a multipart file
after the media steps (resampled to 16 kHz WAV) with the allow-listed fields; every response format is
served (``srt`` and ``vtt`` made of the engine's segments); the guards refuse before any engine call;
the audit record and the per-endpoint metric say what was served; an engine's failure is an OpenAI-shaped
error that names neither the engine nor its words.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
import openai
import pytest
import soundfile as sf
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from gateway.tenants import mint_key
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer, audit_payload, free_port
from tests.media import tone, wav
from tests.plugins import PLUGINS
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

ADMIN = "9d2c4e6f8a0b1c3d5e7f9a1b3c5d7e9f0a2b4c6d"
MODEL = "whisper-1"
SAID = "Your order has shipped. It arrives on Tuesday."
KEY = mint_key()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "audio.md"


def _doc_engine() -> dict:
    """The speech-to-text engine of docs/audio.md's configuration example."""
    for block in re.findall(r"^```yaml\n(.*?)^```", DOCS.read_text(), re.DOTALL | re.MULTILINE):
        doc = yaml.safe_load(block)
        engines = doc.get("engines") if isinstance(doc, dict) else None
        for engine in engines or ():
            if engine.get("kind") == "stt":
                return dict(engine)
    raise AssertionError("docs/audio.md shows no stt engine")


@pytest.fixture(scope="module")
def stt(bg):
    upstream = ScriptedUpstream(Script(text=SAID), models=["openai/whisper-large-v3"])
    bg.run(upstream.start())
    yield upstream
    bg.run(upstream.stop())


@pytest.fixture(scope="module")
def guard_model(bg):
    """A text guard's model served over HTTP: it flags any text that mentions a password."""

    async def classify(request: web.Request) -> web.Response:
        text = (await request.json())["input"]
        return web.json_response({"score": 0.99 if "password" in text.lower() else 0.01})

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/classify", classify)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, port

    runner, port = bg.run(start())
    yield f"http://127.0.0.1:{port}/classify"
    bg.run(runner.cleanup())


@pytest.fixture(scope="module")
def gw(bg, stt, guard_model, tmp_path_factory):
    engine = {**_doc_engine(), "base_url": stt.base_url, "first_byte_timeout_s": 2, "read_timeout_s": 2}
    pre = [
        PolicySpec(name="request-limits"),
        PolicySpec(name="media-limits", config={"audio": {"max_duration_s": 20}}),
        PolicySpec(name="served-guard", config={"url": guard_model}),
    ]
    settings = Settings(
        engines=[EngineConfig(**engine)],
        policies=PolicyChainConfig(pre=pre),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        audit={"sqlite_path": str(tmp_path_factory.mktemp("audit") / "audit.db")},
        admin={"api_key": ADMIN},
        tenants=[{"name": "acme"}],
        api_keys=[{"id": KEY.id, "tenant": "acme", "sha256": KEY.sha256}],
    )
    server = GatewayServer(
        bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}
    ).start()
    yield server
    server.stop()


@pytest.fixture
def up(gw, stt):
    def reset() -> None:
        stt.default = Script(text=SAID)
        stt.clear_queue()
        stt.reset_stats()

    gw.bg.call(reset)

    async def heal() -> None:
        pool = gw.services.pool
        await pool.probe_now()
        for name in pool.engines:
            pool.readmit(name)

    gw.bg.run(heal())
    return stt


@pytest.fixture
def client(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY.key, max_retries=0, timeout=30)


def _clip(seconds: float = 2.0, rate: int = 16000) -> tuple[str, bytes]:
    return ("clip.wav", wav(tone(seconds, rate), rate))


# -- served by the engine's own endpoint ---------------------------------------------------------------------


def test_the_sdk_transcribes_through_the_speech_to_text_engine(client, up):
    got = client.audio.transcriptions.create(
        model=MODEL, file=_clip(rate=44100), language="en", prompt="Tuesday, shipped", temperature=0.2
    )
    assert got.text == SAID
    assert got.usage is not None and got.usage.seconds == pytest.approx(2.0, abs=0.05)
    (form,) = up.transcriptions
    name, content_type, data = form.pop("file")
    # The media steps' audio, not the upload: resampled to Whisper's 16 kHz (and re-encoded losslessly).
    info = sf.info(io.BytesIO(data))
    assert (name, content_type, info.samplerate) == ("audio.wav", "audio/wav", 16000)
    assert info.duration == pytest.approx(2.0, abs=0.05)
    # The engine's own model id, the hints as sent, the text asked for as json; nothing else of the client's.
    assert form == {
        "model": "openai/whisper-large-v3",
        "response_format": "json",
        "language": "en",
        "prompt": "Tuesday, shipped",
        "temperature": "0.2",
    }
    assert up.request_count == 1 and "authorization" not in up.headers[-1]


def test_each_response_format_is_served(client, up):
    assert client.audio.transcriptions.create(model=MODEL, file=_clip(), response_format="text") == SAID
    verbose = client.audio.transcriptions.create(
        model=MODEL, file=_clip(), response_format="verbose_json", timestamp_granularities=["word", "segment"]
    )
    assert verbose.text == SAID and verbose.duration == pytest.approx(2.0, abs=0.05)
    assert [s.text.strip() for s in verbose.segments or ()] == [
        "Your order has shipped.",
        "It arrives on Tuesday.",
    ]
    assert [w.word for w in verbose.words or ()][:3] == ["Your", "order", "has"]
    assert up.transcriptions[-1]["timestamp_granularities[]"] == ["segment", "word"]
    assert up.transcriptions[-1]["response_format"] == "verbose_json"
    srt = client.audio.transcriptions.create(model=MODEL, file=_clip(), response_format="srt")
    assert (
        srt.startswith("1\n00:00:00,000 --> 00:00:01,") and "2\n" in srt and "It arrives on Tuesday." in srt
    )
    vtt = client.audio.transcriptions.create(model=MODEL, file=_clip(), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and "Your order has shipped." in vtt
    # The gateway renders the subtitles from the segments: the engine is asked for verbose_json.
    assert {f["response_format"] for f in up.transcriptions[-2:]} == {"verbose_json"}


def test_granularities_need_verbose_json(client, up):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=MODEL, file=_clip(), timestamp_granularities=["word"])
    assert err.value.body["param"] == "timestamp_granularities[]"
    assert up.request_count == 0


def test_the_call_leaves_its_audit_record(client, up, gw):
    raw = client.audio.transcriptions.with_raw_response.create(model=MODEL, file=_clip())
    record = audit_payload(gw.url, ADMIN, raw.headers["x-request-id"])
    audio = record["notes"]["audio"]
    assert audio["endpoint"] == "transcriptions" and audio["output_chars"] == len(SAID)
    assert audio["input_seconds"] == pytest.approx(2.0, abs=0.05)
    assert record["engine"] == "whisper" and record["outcome"] == "served", record
    assert {p["name"] for p in record["policies"]} >= {"request-limits", "media-limits", "served-guard"}


# -- the guards ----------------------------------------------------------------------------------------------


def test_audio_over_the_media_limit_is_refused_before_the_engine(client, up):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=MODEL, file=_clip(25.0, 16000))
    assert err.value.body["code"] == "invalid_media" and err.value.body["param"] == "file"
    assert up.request_count == 0


def test_the_prompt_is_screened_as_text(client, up):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model=MODEL, file=_clip(), prompt="the password list")
    assert err.value.body["code"] == "content_policy_violation"
    assert up.request_count == 0


def test_a_chat_request_to_the_model_is_refused(client, up):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["param"] == "model" and "/v1/audio/transcriptions" in err.value.body["message"]
    assert up.request_count == 0


# -- the engine's failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, status, code",
    [
        ("500_before_headers", 502, "engine_error"),
        ("503_retry_after", 503, "engine_unavailable"),
        ("malformed_json", 502, "engine_protocol_error"),
        ("hang_before_first_byte", 504, "engine_timeout"),
        ("400_before_headers", 400, "engine_rejected_request"),
    ],
)
def test_an_engine_failure_is_an_openai_error(gw, up, fault, status, code):
    up.default = Script(text=SAID, fault=fault)
    name, data = _clip(1.0, 16000)
    r = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        data={"model": MODEL},
        files={"file": (name, data)},
        headers={"authorization": f"Bearer {KEY.key}"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    # Neither the engine's name nor its own words reach the client.
    assert not re.search(r"whisper|scripted|clip duration", body["error"]["message"], re.IGNORECASE)


# -- metrics -------------------------------------------------------------------------------------------------


def _count(gw, endpoint: str) -> float:
    labels = {"endpoint": endpoint, "outcome": "served"}
    return gw.registry.get_sample_value("omnigate_endpoint_requests_total", labels) or 0.0


def test_requests_are_counted_by_endpoint(client, up, gw):
    before = _count(gw, "transcriptions"), _count(gw, "chat")
    client.audio.transcriptions.create(model=MODEL, file=_clip())
    assert (_count(gw, "transcriptions"), _count(gw, "chat")) == (before[0] + 1, before[1])
    refused = gw.registry.get_sample_value(
        "omnigate_endpoint_requests_total", {"endpoint": "chat", "outcome": "refused"}
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    after = gw.registry.get_sample_value(
        "omnigate_endpoint_requests_total", {"endpoint": "chat", "outcome": "refused"}
    )
    assert after == (refused or 0.0) + 1
