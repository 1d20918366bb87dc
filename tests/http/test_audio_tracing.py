"""The audio endpoints' traces: each call's request span is named after its route (not chat's), says which
endpoint it is, and holds the pre-policies and the engine attempt of the chat completion it was served as,
exported over OTLP to a receiver as for chat (tests/otlp.py)."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from tests.harness import GatewayServer
from tests.media import tone, wav
from tests.otlp import Receiver, Span
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def server(bg, tmp_path_factory):
    up = ScriptedUpstream(Script(flavour="omni", text="Traced words.", audio_chunks=2))
    bg.run(up.start())
    receiver = bg.run(Receiver().start())
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"  # export within 50 ms, not the SDK's 5 s
    settings = Settings(
        engines=[EngineConfig(name="omni", kind="vllm-omni", base_url=up.base_url, model="m", serves=["m"])],
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        audit={"sqlite_path": str(tmp_path_factory.mktemp("audit") / "audit.db")},
        tracing={"enabled": "on", "endpoint": receiver.url},
    )
    gw = GatewayServer(bg, settings).start()
    gw.receiver = receiver
    yield gw
    gw.stop()
    os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
    bg.run(receiver.stop())
    bg.run(up.stop())


def _request_span(receiver: Receiver, trace_id: str, name: str) -> tuple[Span, list[Span]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = receiver.of_trace(trace_id)
        found = [s for s in spans if s.name == name]
        if found:
            return found[0], spans
        time.sleep(0.05)
    raise AssertionError(f"no {name!r} span: {[s.name for s in receiver.spans]}")


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/transcriptions"])
def test_the_request_span_is_named_after_the_audio_route(server, path):
    trace = f"{path.rsplit('/', 1)[1][:4].encode().hex()}{TRACE[8:]}"
    headers = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
    if path.endswith("speech"):
        r = httpx.post(
            server.url + path, json={"model": "m", "input": "Hi.", "voice": "Ethan"}, headers=headers
        )
    else:
        r = httpx.post(
            server.url + path,
            data={"model": "m"},
            files={"file": ("a.wav", wav(tone(0.5), 16000))},
            headers=headers,
        )
    assert r.status_code == 200, r.text
    request, spans = _request_span(server.receiver, trace, f"POST {path}")
    assert request.attributes["url.path"] == path
    assert request.attributes["omnigate.audio.endpoint"] == path.rsplit("/", 1)[1]
    assert request.attributes["omnigate.outcome"] == "served"
    children = {s.name for s in spans if s.parent_span_id == request.span_id}
    assert "chat m" in children and "admission" in children and "POST /v1/chat/completions" not in children
