"""The SSE response on the wire: keep-alive comments on an idle stream, and the drain deadline.

A stream whose engine goes quiet gets ``: keep-alive`` comment frames (which SSE
clients ignore) so idle proxies do not cut it; the text still arrives whole and in
order. A stream still open when the drain deadline passes ends with an
``shutting_down`` error frame and ``[DONE]`` (the full SIGTERM scenario is in
tests/hardening/test_shutdown.py).
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

BODY = {"model": TEXT_MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def quiet_gateway(bg, upstreams, tmp_path):
    upstreams.reset()
    settings = gateway_settings(
        upstreams, server={"sse_keepalive_s": 0.1}, audit={"sqlite_path": str(tmp_path / "audit.db")}
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()


def _lines(url: str) -> list[str]:
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/chat/completions", json=BODY) as resp,
    ):
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]


def test_an_idle_stream_gets_keepalive_comments_and_its_text_whole(quiet_gateway, upstreams) -> None:
    upstreams.bg.call(
        lambda: setattr(
            upstreams.vllm, "default", Script(flavour="vllm", text="one two three", chunk_delay_s=0.45)
        )
    )
    lines = _lines(quiet_gateway.url)
    comments = [line for line in lines if line.startswith(":")]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert comments and set(comments) == {": keep-alive"}
    assert data[-1] == "[DONE]"
    text = "".join((c["delta"].get("content") or "") for d in data[:-1] for c in orjson.loads(d)["choices"])
    assert text == "one two three"
    # The comments sit between the data frames, never inside one.
    first_comment = lines.index(comments[0])
    assert lines[first_comment - 1].startswith("data: ") and lines[-1] == "data: [DONE]"


def test_a_busy_stream_gets_none(quiet_gateway, upstreams) -> None:
    upstreams.bg.call(lambda: setattr(upstreams.vllm, "default", Script(flavour="vllm", chunk_delay_s=0.0)))
    lines = _lines(quiet_gateway.url)
    assert not [line for line in lines if line.startswith(":")]


def test_a_stream_open_at_the_drain_deadline_ends_with_a_terminal_event(quiet_gateway, upstreams) -> None:
    upstreams.bg.call(
        lambda: setattr(
            upstreams.vllm, "default", Script(flavour="vllm", text=" ".join(["w"] * 100), chunk_delay_s=0.05)
        )
    )
    services = quiet_gateway.services
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", quiet_gateway.url + "/v1/chat/completions", json=BODY) as resp,
    ):
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # Drain now with a deadline in 0.3 s (the CLI sets it from drain_delay_s and the grace period).
        quiet_gateway.bg.call(lambda: services.streams.cut_at(time.monotonic() + 0.3))
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = orjson.loads(rest[-2][6:])
    assert error["error"]["code"] == "shutting_down"
    assert len(rest) < 60  # cut well before the 100 words were through
