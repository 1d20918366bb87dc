"""An engine that ignores max_tokens: the gateway cuts the stream itself, cleanly, with finish_reason "length"."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import OMNI_MODEL, TEXT_MODEL
from tests.harness import wait_until
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
