"""Spooled payloads through the front door: the engine gets the client's bytes, and no file outlives
its request, in every shape a request ends in (served, streamed, shrunk, refused, failed over, audited
raw), with the cyclic collector off so that only reference counts free them (a reference cycle that
holds a request would keep its media until the next full collection)."""

from __future__ import annotations

import base64
import gc
import os
import time

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from core import spooled
from gateway.tenants import mint_key
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import data_uri, tone, wav
from tests.upstream import Script

CHAIN = PolicyChainConfig(
    pre=[PolicySpec(name="media-fetch"), PolicySpec(name="media-limits"), PolicySpec(name="nsfw-screen")]
)


def _files() -> set[str]:
    return {f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{os.getpid()}-")}


def _gone(before: set[str]) -> bool:
    """Whether the request's files are gone: at once, or once its audit record is encoded (``raw``
    keeps the request as sent for the record, which the audit writer encodes after the response)."""
    deadline = time.monotonic() + 10
    while not _files() <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module", params=["digests", "raw"])
def gw(request, bg, upstreams, tmp_path_factory):
    """A tenant whose audit keeps digests, or the request as sent (media included, from the spool)."""
    key = mint_key()
    settings = gateway_settings(
        upstreams,
        CHAIN,
        tenants=[{"name": "acme", "audit_content": request.param}],
        api_keys=[{"id": key.id, "tenant": "acme", "sha256": key.sha256}],
        audit={"sqlite_path": str(tmp_path_factory.mktemp("audit") / "a.db")},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    server.key = key.key
    yield server
    server.stop()


@pytest.fixture
def no_collector(upstreams):
    upstreams.reset()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _post(gw: GatewayServer, part: dict, stream: bool = False) -> httpx.Response:
    body = {
        "model": OMNI_MODEL,
        "max_tokens": 8,
        "stream": stream,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is said?"}, part]}],
    }
    return httpx.post(
        gw.url + "/v1/chat/completions",
        content=orjson.dumps(body),
        timeout=60,
        headers={"content-type": "application/json", "authorization": f"Bearer {gw.key}"},
    )


def _sent_part(upstream) -> dict:
    return upstream.requests[-1]["messages"][0]["content"][1]


PASSED = wav(tone(40.0), 16000)  # 1.28 MB at 16 kHz: forwarded as sent
SHRUNK = wav(tone(20.0, rate=44100), 44100)  # resampled: the engine gets a new part


@pytest.mark.usefixtures("no_collector")
@pytest.mark.parametrize("stream", [False, True])
def test_a_passed_through_payload_reaches_the_engine_as_sent_and_its_file_goes(gw, upstreams, stream):
    before = _files()
    uri = data_uri("audio/wav", PASSED)
    resp = _post(gw, {"type": "audio_url", "audio_url": {"url": uri}}, stream)
    assert resp.status_code == 200, resp.text
    assert _sent_part(upstreams.omni_a)["audio_url"]["url"] == uri
    assert _gone(before)


@pytest.mark.usefixtures("no_collector")
def test_input_audio_base64_reaches_the_engine_as_sent(gw, upstreams):
    before = _files()
    b64 = base64.b64encode(PASSED).decode()
    resp = _post(gw, {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})
    assert resp.status_code == 200, resp.text
    assert _sent_part(upstreams.omni_a)["input_audio"]["data"] == b64
    assert _gone(before)


@pytest.mark.usefixtures("no_collector")
def test_a_shrunk_payload_is_replaced_and_its_file_goes(gw, upstreams):
    before = _files()
    resp = _post(gw, {"type": "audio_url", "audio_url": {"url": data_uri("audio/wav", SHRUNK)}})
    assert resp.status_code == 200, resp.text
    sent = _sent_part(upstreams.omni_a)
    sent_bytes = base64.b64decode(
        next(v for v in sent.values() if isinstance(v, dict))["url"].split(",", 1)[1]
    )
    assert len(sent_bytes) < len(SHRUNK) / 2
    assert _gone(before)


@pytest.mark.usefixtures("no_collector")
def test_a_refused_payload_is_refused_as_before_and_its_file_goes(gw):
    before = _files()
    garbage = b"RIFF\0\0\0\0WAVEjunk" * 100_000  # a WAV header over 1.6 MB of nothing decodable
    resp = _post(gw, {"type": "audio_url", "audio_url": {"url": data_uri("audio/wav", garbage)}})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "messages.0.content.1.audio_url.url" and err["type"] == "invalid_request_error"
    assert _gone(before)


@pytest.mark.usefixtures("no_collector")
def test_a_payload_survives_failover_to_the_next_engine(gw, upstreams):
    before = _files()
    gw.bg.call(lambda: upstreams.omni_a.enqueue(Script(flavour="omni", fault="503_retry_after")))
    uri = data_uri("audio/wav", PASSED)
    resp = _post(gw, {"type": "audio_url", "audio_url": {"url": uri}})
    assert resp.status_code == 200, resp.text
    assert _sent_part(upstreams.omni_b)["audio_url"]["url"] == uri  # the whole payload, sent a second time
    assert _gone(before)


@pytest.mark.usefixtures("no_collector")
def test_a_payload_in_a_url_field_without_a_data_header_is_refused_as_a_url(gw):
    b64 = base64.b64encode(PASSED).decode()
    resp = _post(gw, {"type": "audio_url", "audio_url": {"url": b64}})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages.0.content.1.audio_url.url"


@pytest.mark.parametrize("kind", [["input_audio"], {"input_audio": 1}])
def test_a_part_type_that_is_not_a_string_beside_a_payload_is_a_400(gw, kind):
    # The body reader places spooled payloads by their part's type; an unhashable type must be refused
    # by validation like any malformed part, not break the reader with a 500.
    before = _files()
    b64 = base64.b64encode(PASSED).decode()
    resp = _post(gw, {"type": kind, "input_audio": {"data": b64, "format": "wav"}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    assert _gone(before)
