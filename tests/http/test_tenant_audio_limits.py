"""A tenant's ``audio_seconds_per_minute`` over real sockets: two gateways on one Redis.

The seconds of a request's input audio (as media-limits measured them) and of the speech its answer
produced are charged after it; once the window is overdrawn the tenant's next request is a 429 with OpenAI's
error body, on either replica. The audio endpoints are chat requests underneath and are limited the same
way; a realtime turn over the limit is an ``error`` event and a failed response, and the session goes on.
"""

from __future__ import annotations

import base64

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry

from core.errors import RateLimited
from core.settings import TenantConfig
from gateway.tenants import mint_key
from policies.registry import available_plugins
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.http.realtime_helpers import Client
from tests.http.realtime_helpers import tone as pcm_tone
from tests.media import tone, wav
from tests.plugins import PLUGINS
from tests.stores import redis_prefix
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

REDIS_URL = "redis://127.0.0.1:6379/0"
#: each tenant's audio seconds per minute (one tenant per test: the windows last a minute)
LIMITS = {"chat": 3, "talker": 1, "shared": 2, "voice": 1, "transcriber": 2, "speaker": 1}
PREFIX = redis_prefix()


@pytest.fixture(scope="module")
def keys():
    return {name: mint_key() for name in (*LIMITS, "free")}


@pytest.fixture(scope="module")
def pair(bg, upstreams, keys):
    """Two replicas of one config on one Redis: what one charges, the other refuses on."""
    settings = gateway_settings(
        upstreams,
        tenants=[
            *({"name": name, "audio_seconds_per_minute": limit} for name, limit in LIMITS.items()),
            {"name": "free"},
        ],
        api_keys=[{"id": k.id, "tenant": name, "sha256": k.sha256} for name, k in keys.items()],
        rate_limits={"key_prefix": PREFIX},
        redis={"url": REDIS_URL},
        traffic={"key_prefix": f"{PREFIX}:traffic"},
        audit={"enabled": False},
    )
    plugins = {**available_plugins(), **PLUGINS}
    servers = [GatewayServer(bg, settings, CollectorRegistry(), plugins=plugins).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()
    client = redis.Redis.from_url(REDIS_URL)
    stale = list(client.scan_iter(match=PREFIX + "*"))
    if stale:
        client.delete(*stale)
    client.close()


@pytest.fixture
def ups(pair, upstreams):
    upstreams.reset()
    for s in pair:
        s.bg.run(s.services.pool.probe_now())
    return upstreams


def _auth(keys, tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {keys[tenant].key}"}


def _chat(server, keys, tenant: str, seconds: float = 0.0, speak: bool = False) -> httpx.Response:
    content: list[dict] = [{"type": "text", "text": "what do you hear?"}]
    if seconds:
        data = base64.b64encode(wav(tone(seconds), 16000)).decode()
        content.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
    body: dict = {"model": OMNI_MODEL, "messages": [{"role": "user", "content": content}]}
    if speak:
        body |= {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=_auth(keys, tenant), timeout=30)


def _refused(r: httpx.Response) -> dict:
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert err["message"].startswith("Rate limit reached for audio seconds per minute: limit ")
    return err


def _spent(server, tenant: str) -> bool:
    """Whether the tenant's window is overdrawn, as the gateway's own limiter sees it (a check takes
    nothing: the charge lands in the background, after the response)."""
    config = TenantConfig(name=tenant, audio_seconds_per_minute=LIMITS[tenant])
    try:
        server.bg.run(server.services.limiter.admit(config))
    except RateLimited:
        return True
    return False


def test_input_audio_is_charged_until_the_tenant_is_refused(pair, ups, keys):
    a = pair[0]
    refused_before = a.services.metrics.rate_limited.labels("audio")._value.get()
    assert _chat(a, keys, "chat", seconds=2.0).status_code == 200
    assert _chat(a, keys, "chat", seconds=2.0).status_code == 200  # 2 of 3 s used: it may start
    assert wait_until(lambda: _chat(a, keys, "chat", seconds=0.5).status_code == 429, timeout=10)
    asked = ups.omni_a.request_count + ups.omni_b.request_count
    err = _refused(_chat(a, keys, "chat", seconds=0.5))
    assert "limit 3." in err["message"]
    assert ups.omni_a.request_count + ups.omni_b.request_count == asked  # refused before any engine
    assert a.services.metrics.rate_limited.labels("audio")._value.get() >= refused_before + 2
    # A text request of the same tenant is refused too (its audio is spent, not its audio requests),
    # and another tenant is not touched.
    _refused(_chat(a, keys, "chat"))
    assert _chat(a, keys, "free", seconds=2.0).status_code == 200


def test_the_speech_of_the_answer_is_charged(pair, ups, keys):
    a = pair[0]
    ups.omni_a.default = Script(flavour="omni", text="A spoken answer.", audio_chunks=8)  # 1.6 s of speech
    r = _chat(a, keys, "talker", speak=True)
    assert r.status_code == 200 and r.json()["usage"]["output_audio_seconds"] >= 1.5
    assert wait_until(lambda: _spent(a, "talker"), timeout=10)
    _refused(_chat(a, keys, "talker"))


def test_the_window_is_shared_by_the_replicas(pair, ups, keys):
    a, b = pair
    assert _chat(a, keys, "shared", seconds=3.0).status_code == 200  # overdrawn on a
    assert wait_until(lambda: _spent(a, "shared"), timeout=10)
    err = _refused(_chat(b, keys, "shared", seconds=0.5))  # refused on b, which served nothing
    assert "limit 2." in err["message"]
    assert b.services.metrics.rate_limited.labels("audio")._value.get() >= 1


def test_the_audio_endpoints_are_limited_as_chat(pair, ups, keys):
    a = pair[0]
    transcriber = _auth(keys, "transcriber")

    def transcribe(seconds: float) -> httpx.Response:
        return httpx.post(
            a.url + "/v1/audio/transcriptions",
            data={"model": OMNI_MODEL},
            files={"file": ("clip.wav", wav(tone(seconds), 16000))},
            headers=transcriber,
            timeout=30,
        )

    assert transcribe(2.5).status_code == 200
    assert wait_until(lambda: _spent(a, "transcriber"), timeout=10)
    _refused(transcribe(0.5))

    ups.omni_a.default = Script(flavour="omni", text="Hello there.", audio_chunks=8)  # 1.6 s of speech
    doc = {"model": OMNI_MODEL, "input": "Hello there.", "voice": "Ethan", "response_format": "wav"}
    speaker = _auth(keys, "speaker")
    assert httpx.post(a.url + "/v1/audio/speech", json=doc, headers=speaker, timeout=30).status_code == 200
    assert wait_until(lambda: _spent(a, "speaker"), timeout=10)
    _refused(httpx.post(a.url + "/v1/audio/speech", json=doc, headers=speaker, timeout=30))


def _turn(c: Client, seconds: float) -> list[dict]:
    c.append(pcm_tone(seconds))
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    return c.until("response.done")


def test_a_realtime_turn_over_the_limit_is_an_error_event_and_the_session_goes_on(pair, ups, keys):
    a = pair[0]
    ups.omni_a.default = Script(flavour="omni", text="Fine.", audio_chunks=2)  # 0.4 s of speech
    with Client(a.url, keys["voice"].key) as c:
        c.until("session.created")
        c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        c.until("session.updated")
        # 0.8 s heard and 0.4 s spoken: the first turn overdraws the second of the window.
        first = _turn(c, 0.8)
        assert first[-1]["response"]["status"] == "completed"
        assert wait_until(lambda: _spent(a, "voice"), timeout=10)
        asked = ups.omni_a.request_count + ups.omni_b.request_count

        second = _turn(c, 0.3)
        errors = [e for e in second if e["type"] == "error"]
        assert len(errors) == 1
        err = errors[0]["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert err["message"].startswith("Rate limit reached for audio seconds per minute: limit 1. ")
        done = second[-1]["response"]
        assert done["status"] == "failed"
        assert done["status_details"]["error"]["code"] == "rate_limit_exceeded"
        assert ups.omni_a.request_count + ups.omni_b.request_count == asked  # no engine heard it

        # The window ends (its keys expire with it): the same session's next turn is answered.
        client = redis.Redis.from_url(REDIS_URL)
        window = list(client.scan_iter(match=f"{PREFIX}*audio/voice*"))
        assert window
        client.delete(*window)
        client.close()
        assert not _spent(a, "voice")
        third = _turn(c, 0.3)
        assert third[-1]["response"]["status"] == "completed"
        assert not [e for e in third if e["type"] == "error"]
