"""Engine connections are kept: a stream that ended with ``[DONE]`` gives its connection back to the pool.

The engine here writes ``[DONE]`` and, a moment later, the end of its chunked body
(uvicorn under vLLM writes them separately). A connection released before its body
ended is closed by aiohttp, so without reading that end the gateway would open a
new TCP connection to the engine for every request, on the request's way to its
first token. An engine that never ends its body must not hold the client's stream,
nor keep the connection for ever.
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
def own_gateway(bg, upstreams, tmp_path):
    upstreams.reset()
    settings = gateway_settings(upstreams, audit={"sqlite_path": str(tmp_path / "audit.db")})
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()
    upstreams.bg.call(lambda: setattr(upstreams.vllm, "default", Script(flavour="vllm")))


def _script(upstreams, **fields) -> None:
    upstreams.bg.call(lambda: setattr(upstreams.vllm, "default", Script(flavour="vllm", **fields)))
    upstreams.bg.call(upstreams.vllm.reset_stats)


def _text(http: httpx.Client, url: str) -> str:
    with http.stream("POST", url + "/v1/chat/completions", json=BODY) as resp:
        assert resp.status_code == 200
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join((c["delta"].get("content") or "") for d in data[:-1] for c in orjson.loads(d)["choices"])


def test_streams_ending_with_done_reuse_one_engine_connection(own_gateway, upstreams) -> None:
    _script(upstreams, text="one two three", eof_delay_s=0.05)
    with httpx.Client(timeout=30) as http:
        for _ in range(8):
            assert _text(http, own_gateway.url) == "one two three"
            # The next request comes once the engine has ended the previous body, as a client's
            # next turn would; it finds that connection back in the pool.
            time.sleep(0.1)
    stats = upstreams.bg.call(upstreams.vllm.stats)
    assert stats["completed"] == 8
    assert stats["connections"] == 1


def test_an_engine_that_never_ends_its_body_neither_holds_the_stream_nor_the_connection(
    own_gateway, upstreams
) -> None:
    _script(upstreams, text="one two three", eof_delay_s=30)
    with httpx.Client(timeout=30) as http:
        started = time.monotonic()
        assert _text(http, own_gateway.url) == "one two three"
        # The client's stream ends at [DONE], not when the engine's body would (30 s later).
        assert time.monotonic() - started < 10
    # The gateway gives up on the body's end after a bounded wait and drops the connection:
    # the engine sees its handler go (its in-flight count falls back to zero).
    deadline = time.monotonic() + 15
    while upstreams.bg.call(upstreams.vllm.stats)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert upstreams.bg.call(upstreams.vllm.stats)["in_flight"] == 0
