"""The built-in ``request-limits`` policy and the transport's own body cap."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.conftest import TEXT_MODEL

pytestmark = pytest.mark.timeout(60)


def _post(gateway, payload=None, content=None, headers=None) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions", json=payload, content=content, headers=headers, timeout=10
    )


def test_output_tokens_capped_at_8192_and_signalled(gateway, ups):
    resp = _post(
        gateway,
        {
            "model": TEXT_MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 100_000,
        },
    )
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "max-tokens-capped"
    assert ups.vllm.requests[-1]["max_tokens"] == 8192


def test_default_output_budget_is_set(gateway, ups):
    assert (
        _post(gateway, {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "x"}]}).status_code
        == 200
    )
    assert ups.vllm.requests[-1]["max_tokens"] == 8192
    assert (
        "x-omnigate-degraded"
        not in _post(
            gateway, {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10}
        ).headers
    )


def _speech(**extra) -> dict:
    return {
        "model": "qwen3-omni-flash",
        "messages": [{"role": "user", "content": "x"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "chelsie", "format": "wav"},
        **extra,
    }


def test_speech_output_capped_at_2048_and_signalled(gateway, ups):
    resp = _post(gateway, _speech(max_tokens=8000))
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-omnigate-degraded"] == "max-tokens-capped"
    assert ups.omni_a.requests[-1]["max_tokens"] == 2048


def test_speech_default_output_budget_is_the_speech_cap(gateway, ups):
    assert _post(gateway, _speech()).status_code == 200
    assert ups.omni_a.requests[-1]["max_tokens"] == 2048
    resp = _post(gateway, _speech(max_completion_tokens=300))
    assert "x-omnigate-degraded" not in resp.headers
    assert ups.omni_a.requests[-1]["max_tokens"] == 300


def test_text_from_the_speech_model_keeps_the_text_cap(gateway, ups):
    payload = {
        "model": "qwen3-omni-flash",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8000,
    }
    resp = _post(gateway, payload)
    assert resp.status_code == 200
    assert "x-omnigate-degraded" not in resp.headers
    assert ups.omni_a.requests[-1]["max_tokens"] == 8000


def test_too_many_messages(gateway, ups):
    messages = [{"role": "user", "content": "x"}] * 257
    resp = _post(gateway, {"model": TEXT_MODEL, "messages": messages})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages"
    assert ups.vllm.request_count == 0


def test_body_over_the_limit_is_413(gateway, ups):
    big = "x" * (17 * 1024 * 1024)
    resp = _post(gateway, {"model": TEXT_MODEL, "messages": [{"role": "user", "content": big}]})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "payload_too_large"


def test_body_over_transport_limit_refused_before_reading(gateway, ups):
    # A declared 1 GB body is refused from its headers alone: nothing of it is sent.
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n{"
        )
        reply = b""
        while b'"code"' not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413")
    assert b'"code":"payload_too_large"' in reply


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b"[1,2]", None),
        (b'{"model": "text-model"}', "messages"),
        (b'{"model": "text-model", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (
            b'{"model": "text-model", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}',
            "messages.0.content.0",
        ),
        (
            b'{"model": "text-model", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
            "temperature",
        ),
        (b'{"model": "text-model", "messages": [{"role": "user", "content": "x"}], "n": 9}', "n"),
        (
            b'{"model": "text-model", "messages": [{"role": "user", "content": "x"}], "modalities": ["smell"]}',
            "modalities.0",
        ),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(gateway, ups, content, param):
    resp = _post(gateway, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_streamed_audio_format_must_be_streamable(gateway, ups):
    resp = _post(
        gateway,
        {
            "model": "qwen3-omni-flash",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "modalities": ["text", "audio"],
            "audio": {"voice": "a", "format": "mp3"},
        },
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "audio.format"


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405)]
)
def test_routing_errors_are_openai_shaped(gateway, method, path, status):
    resp = httpx.request(method, gateway.url + path)
    assert resp.status_code == status
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
