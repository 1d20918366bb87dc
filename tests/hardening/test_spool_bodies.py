"""Hostile bodies against the media spool, on a real ``omnigate serve``: a body stopped, cut, trickled past
its deadline or over the limit in the middle of a spooled payload leaves no file behind; junk after a
megabyte of base64 is refused as malformed media; many large parts in one body meet the media budget.
Each file is named after the gateway's pid (``/dev/shm/omnigate-<pid>-*``), so only its own are counted."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time

import httpx
import orjson
import pytest
import yaml

from bench.common import free_port
from core import spooled
from tests.media import data_uri, tone, wav

pytestmark = pytest.mark.timeout(180)

BODY_LIMIT = 24 * 1024 * 1024


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    """A gateway with a short body deadline and a scripted vLLM-Omni behind it."""
    up_port, port = free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream", "--port", str(up_port), "--flavour", "omni"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cfg = tmp_path_factory.mktemp("gw") / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "engines": [
                    {
                        "name": "omni",
                        "kind": "vllm-omni",
                        "base_url": f"http://127.0.0.1:{up_port}/v1",
                        "model": "scripted",
                        "serves": ["omni"],
                        "input_modalities": ["text", "image", "audio", "video"],
                    }
                ],
                "server": {"body_timeout_s": 2.0, "max_body_bytes": BODY_LIMIT},
                "media": {"max_request_bytes": 8 * 1024 * 1024},
                "logging": {"level": "warning"},
                "routing": {"controller": {"enabled": False}},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.2)
    yield {"url": url, "port": port, "pid": proc.pid}
    proc.terminate()
    engine.terminate()
    proc.wait(30)
    engine.wait(10)


def _files(pid: int) -> list[str]:
    return [f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{pid}-")]


def _none_left(pid: int, within_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + within_s
    while (left := _files(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _head(port: int, length: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % length
    )
    return sock


def _opening(kind: str = "input_audio") -> bytes:
    """A body up to the start of a media payload (its string left open)."""
    head = b'{"model": "omni", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "input_audio", '
    return head + b'"input_audio": {"format": "wav", "data": "'


B64 = base64.b64encode(os.urandom(3 << 20))  # 4 MiB of base64: spooled after its first MiB


def _spooling(gw: dict, sock: socket.socket) -> None:
    """Wait until the gateway has started a file for the payload being sent."""
    deadline = time.monotonic() + 20
    while not _files(gw["pid"]):
        assert time.monotonic() < deadline, "no payload was spooled"
        time.sleep(0.02)


def test_a_client_gone_mid_payload_leaves_no_file(gw):
    sock = _head(gw["port"], 10 * 1024 * 1024)
    sock.sendall(_opening() + B64[: 3 << 20])
    _spooling(gw, sock)
    sock.close()  # gone, with the payload half sent
    assert _none_left(gw["pid"]) == []


def test_a_body_past_its_deadline_mid_payload_is_408_and_leaves_no_file(gw):
    sock = _head(gw["port"], 10 * 1024 * 1024)
    sock.sendall(_opening() + B64[: 3 << 20])
    _spooling(gw, sock)
    reply = sock.recv(65536)  # nothing more sent: server.body_timeout_s (2 s) runs out
    sock.close()
    assert reply.split(b" ", 2)[1] == b"408"
    assert _none_left(gw["pid"]) == []


def test_a_body_over_the_limit_mid_payload_is_413_and_leaves_no_file(gw):
    raw = _opening() + base64.b64encode(os.urandom(BODY_LIMIT)) + b'"}}]}]}'
    resp = httpx.post(
        gw["url"] + "/v1/chat/completions",
        content=iter([raw[i : i + 65536] for i in range(0, len(raw), 65536)]),
        headers={"content-type": "application/json"},
        timeout=60,
    )  # chunked: no length declared
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert _none_left(gw["pid"]) == []


def test_junk_after_a_megabyte_of_base64_is_malformed_media(gw):
    data = B64[: 2 << 20].decode() + "!!!!" + B64[2 << 20 :].decode()
    body = {
        "model": "omni",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}],
            }
        ],
    }
    resp = httpx.post(
        gw["url"] + "/v1/chat/completions",
        content=orjson.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "messages.0.content.0.input_audio.data" and "base64" in err["message"]
    assert _none_left(gw["pid"]) == []


def test_many_large_parts_in_one_body_meet_the_media_budget(gw):
    # Five 1.3 MB payloads, each spooled, together over media.max_request_bytes (8 MiB) once decoded.
    part = {"type": "audio_url", "audio_url": {"url": data_uri("audio/wav", wav(tone(60.0), 16000))}}
    body = {"model": "omni", "max_tokens": 4, "messages": [{"role": "user", "content": [part] * 5}]}
    resp = httpx.post(
        gw["url"] + "/v1/chat/completions",
        content=orjson.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["code"] == "media_too_large" and err["param"].startswith("messages.0.content.")
    assert _none_left(gw["pid"]) == []
    # and the gateway goes on serving
    ok = {"model": "omni", "max_tokens": 4, "messages": [{"role": "user", "content": [part]}]}
    assert httpx.post(gw["url"] + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    assert _none_left(gw["pid"]) == []
