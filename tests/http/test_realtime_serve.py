"""``/v1/realtime`` as ``omnigate serve`` serves it: the server process users run.

The other realtime tests run the app in the suite's own server; this one starts ``omnigate serve`` with a
config file, as users do, and holds a spoken turn through it (the WebSocket upgrade must pass the
server's own HTTP protocol, which bounds request heads), and a frame over the server's WebSocket size
bound closes the connection rather than being buffered whole.
"""

from __future__ import annotations

import pytest
import yaml
from websockets.exceptions import ConnectionClosed

from tests.harness import ServeProcess, wait_until
from tests.http.realtime_helpers import Client, b64, tone
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

MODEL = "voice"


@pytest.fixture
def engine(bg):
    up = ScriptedUpstream(Script(flavour="omni", text="Hello there.", audio_chunks=3))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


def _config(tmp_path, engine, **realtime) -> tuple:
    cfg = {
        "engines": [
            {"name": "omni", "kind": "vllm-omni", "base_url": engine.base_url, "model": "scripted",
             "variant": "bf16", "serves": [MODEL]}
        ],
        "auth": {"required": False},
        "logging": {"level": "warning"},
        "audit": {"sqlite_path": str(tmp_path / "audit.db")},
        "routing": {"controller": {"enabled": False}},
        **({"realtime": realtime} if realtime else {}),
    }  # fmt: skip
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _turn(url: str) -> None:
    c = Client(url, None, model=MODEL)
    try:
        c.until("session.created")
        c.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        c.until("session.updated")
        c.append(tone(0.5))
        c.send({"type": "input_audio_buffer.commit"})
        c.send({"type": "response.create"})
        events = c.until("response.done", timeout=30)
        assert events[-1]["response"]["status"] == "completed", events[-1]
        assert any(e["type"] == "response.output_audio.delta" for e in events)
    finally:
        c.close()


def test_omnigate_serve_holds_a_realtime_turn(tmp_path, engine):
    server = ServeProcess(_config(tmp_path, engine, max_frame_bytes=64 * 1024), tmp_path / "serve.log")
    try:
        assert wait_until(server.ready, timeout=60, interval=0.2)
        _turn(server.url)
        # a frame far over the session's bound is not read whole: the connection is closed
        c = Client(server.url, None, model=MODEL)
        try:
            c.until("session.created")
            with pytest.raises(ConnectionClosed):
                c.send({"type": "input_audio_buffer.append", "audio": b64(tone(30.0))})  # ~1.9 MB
                c.until("never", timeout=10)
        finally:
            c.close()
        _turn(server.url)  # and the server goes on serving
    finally:
        server.stop()
