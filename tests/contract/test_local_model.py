"""The embedded default: a real SmolLM2-135M-Instruct answering through the gateway, with no config file."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import DEFAULT_PUBLIC_MODEL
from gateway.settings import load_settings
from tests.harness import GatewayServer, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def local_gateway(bg):
    server = GatewayServer(bg, load_settings(None), CollectorRegistry()).start(wait_ready=False)
    # The model loads in the background: not ready until then, but alive.
    first = httpx.get(server.url + "/readyz")
    alive = httpx.get(server.url + "/healthz")
    assert wait_until(lambda: server.bg.call(lambda: server.services.pool.ready), timeout=240, interval=0.2)
    yield server, first, alive
    server.stop()


def test_readiness_follows_the_model_load(local_gateway):
    server, first, alive = local_gateway
    assert alive.status_code == 200
    assert first.status_code == 503 and first.json() == {"status": "not_ready"}  # detail is the admin's
    assert httpx.get(server.url + "/readyz").status_code == 200


def test_local_model_answers_a_real_question(local_gateway):
    server, _, _ = local_gateway
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [DEFAULT_PUBLIC_MODEL]
    stream = client.chat.completions.create(
        model=DEFAULT_PUBLIC_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        max_tokens=40,
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            finish = c.finish_reason or finish
    text = "".join(pieces)
    assert len(pieces) > 1  # it streams token by token, not as one block
    assert re.search(r"[A-Za-z]{3,}", text) and text.isascii()
    assert "Paris" in text
    assert finish in ("stop", "length")
    assert usage is not None and usage.prompt_tokens > 10
    assert len(pieces) <= usage.completion_tokens <= 40
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_speech_request_to_the_text_only_local_engine_is_degraded(local_gateway):
    server, _, _ = local_gateway
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": DEFAULT_PUBLIC_MODEL,
            "messages": [{"role": "user", "content": "Say hi."}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "wav"},
            "max_tokens": 8,
        },
        timeout=120,
    )
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "engine-text-only"
    body = resp.json()
    assert body["choices"][0]["message"]["content"]
    assert "audio" not in body["choices"][0]["message"]
    assert body["usage"]["completion_tokens"] <= 8
