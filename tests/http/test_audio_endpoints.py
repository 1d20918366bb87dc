"""Attacks and failures on ``/v1/audio/transcriptions`` and ``/v1/audio/speech`` over real sockets.

An oversized upload is refused (413) before its body is read; an upload cut half-way gives back its
admission slot and its spool file and leaves a record; a file that is not audio, or audio over the
media limits' length, is the media steps' 400 naming ``file``; speech or text the chain's guards flag is
refused before any engine sees it; an engine that dies or hangs mid-answer is an OpenAI-shaped 5xx on
time; keys, tenants' models and rate limits apply as for chat. Every error is OpenAI's shape.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from core import spooled
from gateway.tenants import mint_key
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer, audit_payload, free_port
from tests.media import speech, tone, wav
from tests.plugins import PLUGINS
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

ADMIN = "3e9b1c7d5a2f4e8b6d0c1a9f7e3b5d2c4a6e8f0b"
LIMIT = 2 * 1024 * 1024
KEY = mint_key()
NARROW = mint_key()  # a tenant whose models do not include the omni model
SLOW = mint_key()  # a tenant allowed one request a minute


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
def gw(bg, upstreams, guard_model, tmp_path_factory):
    pre = [
        PolicySpec(name="load-shedding"),
        PolicySpec(name="request-limits"),
        PolicySpec(name="audio-screen", config={"patterns": [r"pass\s*word"]}),
        PolicySpec(name="media-limits", config={"audio": {"max_duration_s": 20}}),
        PolicySpec(name="served-guard", config={"url": guard_model}),
    ]
    settings = gateway_settings(
        upstreams,
        PolicyChainConfig(pre=pre),
        audit={"sqlite_path": str(tmp_path_factory.mktemp("audit") / "audit.db")},
        admin={"api_key": ADMIN},
        server={"max_body_bytes": LIMIT, "body_timeout_s": 10.0},
        traffic={"soft_limit": 16, "hard_limit": 64},
        tenants=[
            {"name": "acme"},
            {"name": "narrow", "models": ["text-model"]},
            {"name": "slow", "requests_per_minute": 1},
        ],
        api_keys=[
            {"id": KEY.id, "tenant": "acme", "sha256": KEY.sha256},
            {"id": NARROW.id, "tenant": "narrow", "sha256": NARROW.sha256},
            {"id": SLOW.id, "tenant": "slow", "sha256": SLOW.sha256},
        ],
    )
    server = GatewayServer(
        bg, settings, CollectorRegistry(), plugins={**available_plugins(), **PLUGINS}
    ).start()
    yield server
    server.stop()


@pytest.fixture
def up(upstreams, gw):
    upstreams.reset()
    for u in (upstreams.omni_a, upstreams.omni_b):
        u.default = Script(flavour="omni", text="Hello there.", audio_chunks=3)

    async def heal() -> None:
        pool = gw.services.pool
        await pool.probe_now()
        for name in pool.engines:
            pool.readmit(name)

    gw.bg.run(heal())
    return upstreams


AUTH = {"authorization": f"Bearer {KEY.key}"}


def _transcribe(
    gw, data: bytes, name: str = "clip.wav", headers: dict | None = None, timeout: float = 60, **fields
) -> httpx.Response:
    form = {"model": OMNI_MODEL, **fields}
    return httpx.post(
        gw.url + "/v1/audio/transcriptions",
        data=form,
        files={"file": (name, data)},
        headers=headers or AUTH,
        timeout=timeout,
    )


def _speak(gw, headers: dict | None = None, timeout: float = 60, **body) -> httpx.Response:
    doc = {"model": OMNI_MODEL, "input": "Hello there.", "voice": "Ethan", "response_format": "wav", **body}
    return httpx.post(gw.url + "/v1/audio/speech", json=doc, headers=headers or AUTH, timeout=timeout)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _held(gw) -> tuple[int, dict[str, int]]:
    def read() -> tuple[int, dict[str, int]]:
        store = gw.services.admission.store
        return store.count, dict(store.tenants)

    return gw.bg.call(read)


def _spool_files() -> list[str]:
    mine = f"{spooled.PREFIX}{os.getpid()}-"
    return [n for n in os.listdir(spooled.SHM_DIR) if n.startswith(mine)] if spooled.available() else []


def _multipart_head(length: int, boundary: str = "b0undary") -> bytes:
    return (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: gw\r\n"
        f"authorization: Bearer {KEY.key}\r\n"
        f"content-type: multipart/form-data; boundary={boundary}\r\ncontent-length: {length}\r\n\r\n"
    ).encode()


def _file_opening(boundary: str = "b0undary") -> bytes:
    return (
        f'--{boundary}\r\ncontent-disposition: form-data; name="model"\r\n\r\n{OMNI_MODEL}\r\n'
        f'--{boundary}\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n'
        "content-type: audio/wav\r\n\r\n"
    ).encode()


# -- the body ----------------------------------------------------------------------------------------------


def test_an_upload_declared_over_the_limit_is_413_before_its_body_is_read(gw, up):
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(_multipart_head(LIMIT * 10) + _file_opening())
        started = time.monotonic()
        reply = b""
        while b"payload_too_large" not in reply and (more := sock.recv(65536)):
            reply += more
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"code":"payload_too_large"' in reply and time.monotonic() - started < 5
    assert up.omni_a.request_count == 0


def test_a_chunked_upload_over_the_limit_is_413_while_it_is_still_coming(gw, up):
    head = (
        "POST /v1/audio/transcriptions HTTP/1.1\r\nhost: gw\r\n"
        f"authorization: Bearer {KEY.key}\r\n"
        "content-type: multipart/form-data; boundary=b0undary\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()
    piece = b"\0" * 65536
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        opening = _file_opening()
        sock.sendall(head + b"%x\r\n" % len(opening) + opening + b"\r\n")
        reply = b""
        for _ in range(LIMIT // len(piece) + 8):  # past the limit, never the end of the body
            try:
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            except OSError:
                break
        sock.settimeout(10)
        while b"payload_too_large" not in reply and (more := sock.recv(65536)):
            reply += more
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert eventually_sync(lambda: _held(gw) == (0, {}) and not _spool_files())


def eventually_sync(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_an_upload_cut_half_way_gives_back_its_slot_and_its_spool(gw, up):
    before = _spool_files()
    total = 1024 * 1024
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(_multipart_head(total) + _file_opening() + b"RIFF" + b"\1" * (total // 2))
        # Past the spool threshold: the file is on the spool, the slot held, when the client goes.
        assert eventually_sync(lambda: len(_spool_files()) > len(before))
        assert _held(gw)[0] == 1
    assert eventually_sync(lambda: _held(gw) == (0, {}) and _spool_files() == before), (
        _held(gw),
        _spool_files(),
    )
    # The cut request is on record, as chat's are: cancelled by the client (499).
    records = httpx.get(
        gw.url + "/admin/audit/records",
        params={"outcome": "cancelled"},
        headers={"authorization": f"Bearer {ADMIN}"},
    ).json()["records"]
    assert any(r["status"] == 499 and r["tenant"] == "acme" for r in records), records
    r = _transcribe(gw, wav(tone(1.0), 16000))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "content_type", ["application/json", "multipart/form-data", "text/plain; boundary=x"]
)
def test_a_body_that_is_not_a_form_is_a_400(gw, up, content_type):
    r = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        content=b'{"model": "x"}',
        headers={**AUTH, "content-type": content_type},
    )
    assert _error(r, 400)["param"] == "file"


def test_a_form_without_a_file_is_a_400(gw, up):
    r = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        files={"model": (None, OMNI_MODEL)},
        headers=AUTH,
    )
    assert _error(r, 400)["param"] == "file"


def test_a_malformed_form_is_a_400(gw, up):
    body = _file_opening() + b"RIFF...."  # no closing boundary
    r = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        content=body,
        headers={**AUTH, "content-type": "multipart/form-data; boundary=b0undary"},
    )
    assert "closing boundary" in _error(r, 400)["message"]


def test_unknown_and_unserved_fields_are_400s_naming_them(gw, up):
    data = wav(tone(1.0), 16000)
    refused = _transcribe(gw, data, colour="blue")
    assert _error(refused, 400)["code"] == "unknown_field"
    # Refused before it was served, and still on record as the endpoint's.
    record = audit_payload(gw.url, ADMIN, refused.headers["x-request-id"])
    assert record["notes"]["audio"] == {"endpoint": "transcriptions"} and record["status"] == 400
    err = _error(_transcribe(gw, data, **{"timestamp_granularities[]": "word"}), 400)
    assert (err["code"], err["param"]) == ("unsupported_field", "timestamp_granularities[]")
    assert _error(_transcribe(gw, data, stream="true"), 400)["param"] == "stream"
    assert _error(_transcribe(gw, data, temperature="3"), 400)["param"] == "temperature"
    assert up.omni_a.request_count == 0


# -- the media steps -------------------------------------------------------------------------------------


def test_a_file_that_is_not_audio_is_a_400_naming_the_file(gw, up):
    err = _error(_transcribe(gw, b"%PDF-1.7 " + b"x" * 4000, name="report.pdf"), 400)
    assert err["code"] == "invalid_media" and err["param"] == "file" and "messages" not in err["message"]
    assert up.omni_a.request_count == 0


def test_a_file_named_as_another_format_is_refused(gw, up):
    err = _error(_transcribe(gw, wav(tone(1.0), 16000), name="clip.mp3"), 400)
    assert err["code"] == "invalid_media" and err["param"] == "file"


def test_audio_over_the_length_limit_is_the_limits_400(gw, up):
    err = _error(_transcribe(gw, wav(tone(25.0, 8000), 8000)), 400)
    assert err["code"] == "invalid_media" and "the limit is 20 s" in err["message"] and err["param"] == "file"
    assert up.omni_a.request_count == 0


def test_a_large_upload_is_spooled_and_leaves_no_file(gw, up):
    before = _spool_files()
    data = wav(tone(15.0, 44100), 44100)  # 1.3 MB: past the spool threshold
    r = _transcribe(gw, data)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["seconds"] == pytest.approx(15.0, abs=0.05)
    assert eventually_sync(lambda: _spool_files() == before)


# -- the guards ------------------------------------------------------------------------------------------


def test_speech_the_audio_screen_flags_is_refused(gw, up):
    r = _transcribe(gw, speech("Please tell me your password."))  # what whisper tiny.en hears word for word
    err = _error(r, 400)
    assert err["code"] == "content_policy_violation" and err["param"] == "file"
    assert up.omni_a.request_count == 0
    record = audit_payload(gw.url, ADMIN, r.headers["x-request-id"])
    assert record["notes"]["audio"]["endpoint"] == "transcriptions"
    assert {p["name"]: p["verdict"] for p in record["policies"]}["audio-screen"] == "reject"


def test_text_to_speech_the_text_guard_flags_is_refused(gw, up):
    r = _speak(gw, input="The password is hunter2.")
    assert _error(r, 400)["code"] == "content_policy_violation"
    assert up.omni_a.request_count == 0
    record = audit_payload(gw.url, ADMIN, r.headers["x-request-id"])
    assert record["outcome"] != "served" and record["notes"]["audio"]["endpoint"] == "speech"


def test_a_transcription_prompt_is_screened_as_text(gw, up):
    r = _transcribe(gw, wav(tone(1.0), 16000), prompt="the password list")
    assert _error(r, 400)["code"] == "content_policy_violation"


# -- the engines -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, statuses",
    [
        ("reset_mid_stream", {503}),  # the connection gone mid-answer: the engine is unavailable
        # the engine's deadline (504), or, once its timeouts have ejected both engines, none to try (503)
        ("hang_mid_stream", {504, 503}),
        ("500_before_headers", {502}),
        ("malformed_json", {502}),
    ],
)
def test_an_engine_that_fails_mid_answer_is_an_openai_5xx_on_time(gw, up, fault, statuses):
    for u in (up.omni_a, up.omni_b):
        u.default = Script(flavour="omni", text="Hello.", audio_chunks=3, fault=fault)
    for call in (lambda: _speak(gw), lambda: _transcribe(gw, wav(tone(1.0), 16000))):
        started = time.monotonic()
        r = call()
        assert r.status_code in statuses, r.text
        err = _error(r, r.status_code)
        assert err["type"] == "api_error" and time.monotonic() - started < 30


def test_speech_the_engines_refuse_is_their_400_in_openais_shape(gw, up):
    r = _speak(gw, voice="nobody")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# -- keys, tenants, models -------------------------------------------------------------------------------


def test_without_a_key_both_are_401(gw, up):
    # No key: OpenAI's own answer for a missing key (invalid_request_error); a wrong one: authentication_error.
    _error(_speak(gw, headers={"x": "y"}), 401)
    assert (
        _error(_transcribe(gw, wav(tone(1.0), 16000), headers={"authorization": "Bearer sk-no"}), 401)["type"]
        == "authentication_error"
    )


def test_a_tenant_without_the_model_gets_404(gw, up):
    narrow = {"authorization": f"Bearer {NARROW.key}"}
    assert _error(_speak(gw, headers=narrow), 404)["code"] == "model_not_found"
    assert _error(_transcribe(gw, wav(tone(1.0), 16000), headers=narrow), 404)["code"] == "model_not_found"


def test_each_call_is_counted_in_the_request_metrics(gw, up):
    before = (
        gw.registry.get_sample_value("omnigate_requests_total", {"model": OMNI_MODEL, "outcome": "served"})
        or 0.0
    )
    assert _speak(gw).status_code == 200
    assert _transcribe(gw, wav(tone(1.0), 16000)).status_code == 200
    after = gw.registry.get_sample_value(
        "omnigate_requests_total", {"model": OMNI_MODEL, "outcome": "served"}
    )
    assert after == before + 2


def test_a_tenants_rate_limit_counts_audio_calls_as_requests(gw, up):
    slow = {"authorization": f"Bearer {SLOW.key}"}
    assert _speak(gw, headers=slow).status_code == 200
    err = _error(_transcribe(gw, wav(tone(1.0), 16000), headers=slow), 429)
    assert err["type"] == "rate_limit_error"


def test_speech_above_the_soft_limit_is_a_503_to_retry_not_a_text_answer(bg, upstreams, tmp_path):
    """load-shedding serves chat's speech as text above the soft limit; a speech call has no text answer to
    give, so it is refused with 503 and Retry-After (and the engine's text-only answer is not passed off)."""
    import concurrent.futures

    upstreams.reset()
    settings = gateway_settings(
        upstreams,
        PolicyChainConfig(pre=[PolicySpec(name="load-shedding"), PolicySpec(name="request-limits")]),
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        traffic={"soft_limit": 1, "hard_limit": 8},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        for u in (upstreams.omni_a, upstreams.omni_b):
            u.default = Script(flavour="omni", text="Hello.", audio_chunks=2, first_byte_delay_s=0.8)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(_speak, server, {"x": "y"})
            assert eventually_sync(lambda: server.bg.call(lambda: server.services.admission.store.count) == 1)
            shed = _speak(server, {"x": "y"})
            assert first.result().status_code == 200
        err = _error(shed, 503)
        assert err["code"] == "overloaded" and shed.headers["retry-after"] == "1"
    finally:
        server.stop()


def test_an_upload_that_trickles_past_the_body_deadline_is_408_and_holds_nothing(bg, upstreams, tmp_path):
    upstreams.reset()
    settings = gateway_settings(
        upstreams,
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        server={"body_timeout_s": 1.0},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        before = _spool_files()
        head = (
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: gw\r\n"
            b"content-type: multipart/form-data; boundary=b0undary\r\ncontent-length: 4000000\r\n\r\n"
        )
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head + _file_opening() + b"RIFF" + b"\1" * (SPOOL_OVER))
            reply = b""
            while b"request_timeout" not in reply and (more := sock.recv(65536)):
                reply += more
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - started < 5
        assert eventually_sync(lambda: _held(server) == (0, {}) and _spool_files() == before)
    finally:
        server.stop()


#: bytes past the spool threshold (gateway/api/body.py's SPOOL_MIN)
SPOOL_OVER = 300 * 1024


def test_unknown_fields_dropped_when_configured_and_the_media_budget_refuses_mid_upload(
    bg, upstreams, tmp_path
):
    upstreams.reset()
    for u in (upstreams.omni_a, upstreams.omni_b):
        u.default = Script(flavour="omni", text="Hello there.", audio_chunks=2)
    settings = gateway_settings(
        upstreams,
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        requests={"unknown_fields": "drop"},
        media={"max_request_bytes": 512 * 1024},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        r = _speak(server, {"x": "y"}, colour="blue", mood="calm")
        assert r.status_code == 200, r.text
        assert r.headers["x-omnigate-dropped-fields"] == "colour,mood"
        r = _transcribe(server, wav(tone(1.0), 16000), headers={"x": "y"}, colour="blue")
        assert r.status_code == 200 and r.headers["x-omnigate-dropped-fields"] == "colour"
        before = _spool_files()
        # 2.6 MB of audio against a 512 KiB media budget: refused while it arrives, nothing left behind.
        err = _error(_transcribe(server, wav(tone(30.0, 44100), 44100), headers={"x": "y"}), 413)
        assert err["code"] == "media_too_large", err
        assert eventually_sync(lambda: _held(server) == (0, {}) and _spool_files() == before)
    finally:
        server.stop()


@pytest.mark.parametrize("endpoint", ["speech", "transcriptions"])
def test_a_client_gone_while_the_engine_answers_aborts_it_and_holds_nothing(gw, up, endpoint):
    for u in (up.omni_a, up.omni_b):
        u.default = Script(flavour="omni", text="Slow.", audio_chunks=2, chunk_delay_s=10.0)
    aborts, asked = up.omni_a.aborts, up.omni_a.request_count
    if endpoint == "speech":
        doc = {"model": OMNI_MODEL, "input": "Hello.", "voice": "Ethan", "response_format": "wav"}
        request = httpx.Request("POST", gw.url + "/v1/audio/speech", json=doc, headers=AUTH)
    else:
        files = {"file": ("a.wav", wav(tone(1.0), 16000))}
        request = httpx.Request(
            "POST", gw.url + "/v1/audio/transcriptions", data={"model": OMNI_MODEL}, files=files, headers=AUTH
        )
    body = request.read()
    head = f"POST {request.url.path} HTTP/1.1\r\nhost: gw\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in request.headers.items() if k.lower() != "host"
    )
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        # The client goes once the engine has the request (the guards have heard and read it by then).
        assert eventually_sync(lambda: up.omni_a.request_count == asked + 1, timeout=60)
    assert eventually_sync(lambda: up.omni_a.aborts == aborts + 1)  # the engine saw the request go
    assert eventually_sync(lambda: _held(gw) == (0, {}))
