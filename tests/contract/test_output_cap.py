"""An engine that ignores max_tokens: the gateway cuts the stream itself, cleanly, with finish_reason "length"."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from policies.settings import PolicyChainConfig
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer, wait_until
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

TEN = "one two three four five six seven eight nine ten"


def test_stream_is_cut_at_the_cap_when_the_engine_ignores_it(client, ups, gateway):
    ups.vllm.default = Script(flavour="vllm", text=TEN, ignore_max_tokens=True)
    raw = client.chat.completions.with_raw_response.create(
        model=TEXT_MODEL,
        messages=[{"role": "user", "content": "count"}],
        stream=True,
        max_tokens=4,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in raw.parse():
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == "one two three four "
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 4
    # Found out after the headers went: announced by finish_reason and counted, not as a header.
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'omnigate_degradations_total{reason="output-capped"}' in metrics
    assert ups.vllm.requests[-1]["max_tokens"] == 4
    # The rest of the runaway generation is not read: the upstream request is closed.
    assert wait_until(lambda: ups.vllm.aborts + ups.vllm.completed == 1)


def test_an_engine_that_honours_the_cap_is_not_flagged(client, ups):
    ups.vllm.default = Script(flavour="vllm", text=TEN)
    raw = client.chat.completions.with_raw_response.create(
        model=TEXT_MODEL,
        messages=[{"role": "user", "content": "count"}],
        stream=True,
        max_tokens=4,
    )
    finish = None
    for chunk in raw.parse():
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    assert finish == "length"
    assert "x-omnigate-degraded" not in raw.headers


def test_default_cap_applies_to_speech_streams_too(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=TEN, ignore_max_tokens=True, audio_chunks=2)
    stream = client.chat.completions.create(
        model=OMNI_MODEL,
        messages=[{"role": "user", "content": "count"}],
        stream=True,
        max_tokens=3,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
    )
    transcript, finish, audio_pieces = "", None, 0
    for chunk in stream:
        for choice in chunk.choices:
            audio = getattr(choice.delta, "audio", None)
            if audio:
                get = audio.get if isinstance(audio, dict) else lambda k, audio=audio: getattr(audio, k, None)
                transcript += get("transcript") or ""
                audio_pieces += 1 if get("data") else 0
            finish = choice.finish_reason or finish
    assert transcript == "one two three "
    assert finish == "length"
    assert audio_pieces == 0  # cut before the speech of the runaway text began


@pytest.fixture(scope="module")
def bare(bg, upstreams):
    """A gateway whose chain names no policy (the fixed media steps only): no request-limits to hold the cap."""
    server = GatewayServer(
        bg, gateway_settings(upstreams, PolicyChainConfig(pre=[])), CollectorRegistry()
    ).start()
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_the_cap_holds_without_request_limits(bare, ups, stream):
    assert "request-limits" not in [p.name for p in bare.services.chain.all()]
    ups.vllm.default = Script(flavour="vllm", text=TEN, ignore_max_tokens=True)
    with openai.OpenAI(base_url=bare.url + "/v1", api_key="unused", max_retries=0, timeout=20) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=TEXT_MODEL, messages=[{"role": "user", "content": "count"}], stream=stream, max_tokens=4
        )
        if stream:
            text, finish = "", None
            for chunk in raw.parse():
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        else:
            # A whole answer cannot be cut exactly (no pieces to count, no tokenizer of the engine's
            # model): it is served as the engine sent it and announced.
            done = raw.parse()
            assert done.usage.completion_tokens == 10
            assert raw.headers["x-omnigate-degraded"] == "output-over-cap"
            assert (
                'omnigate_degradations_total{reason="output-over-cap"}'
                in httpx.get(bare.url + "/metrics").text
            )
            return
    assert text == "one two three four "
    assert finish == "length"
