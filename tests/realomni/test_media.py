"""Large media inputs through the gateway to the real vLLM-Omni: an audio part and an image part, each over
the spool's threshold, so the gateway moves them out of the body into a shared-memory file as they arrive
and re-encodes them piece by piece into the engine's body. The weights are random, so what is asserted is
what the engine made of the media: the same prompt tokens as for the same request sent to it straight (a
payload cut, padded or re-encoded wrongly would not decode, or would count differently), an OpenAI-shaped
answer, and no spool file left once the request is done. The media steps run in every chain (defaults
where not configured): a part they leave as it is goes to the engine as the client sent it."""

from __future__ import annotations

import base64
import os
import time

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from core import spooled
from gateway.api.body import SPOOL_MIN
from policies.media.image import target_size
from policies.settings import PolicySpec
from tests.harness import GatewayServer
from tests.media import data_uri, png, tone, wav
from tests.realomni.conftest import MODEL, omni_settings

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(2400)]

QUESTION = {"type": "text", "text": "What is this?"}
TEXT_ONLY = [{"role": "user", "content": [QUESTION]}]
# Qwen3-Omni's audio encoder makes 13 tokens of each 100 mel frames (a second at 16 kHz), so 20 s are about
# 265 tokens of the stage's 2,048 (and two for the audio's start and end). Not a whole number of seconds:
# the count does not sit on a window's boundary, where a resampler's sample more or less would change it.
AUDIO_S = 20.37
WAV_16K = wav(tone(AUDIO_S), 16000)  # 652 KB, 869 KB of base64
WAV_44K = wav(tone(AUDIO_S, rate=44100), 44100)  # 1.8 MB: media-limits resamples it to 16 kHz
# The image processor makes a token per 32x32 pixels (16 px patches merged 2x2): 144 tokens.
IMAGE_SIDE = 384
# Downsampled by media-limits to its max_pixels (aspect kept); at full size 32 x 24 = 768 tokens.
LARGE_IMAGE = (1024, 768)
MAX_PIXELS = 100_000


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of noise: incompressible, so its size is its pixels' (3 bytes each)."""
    rng = np.random.default_rng(seed)
    return png(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))


PNG = noise_png(IMAGE_SIDE, IMAGE_SIDE)  # 443 KB, 590 KB of base64


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri("image/png", data)}}


def _files() -> set[str]:
    """The spool files of this process: the gateway runs in it (tests.harness.GatewayServer)."""
    return {f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{os.getpid()}-")}


def _gone(before: set[str]) -> bool:
    """Whether the request's files are gone: at once, or once the request's audit record is written."""
    deadline = time.monotonic() + 10
    while not _files() <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def spooled_sizes(monkeypatch) -> list[int]:
    """The decoded size of every payload the gateway spools while the test runs."""
    sizes: list[int] = []
    finish = spooled.SpoolWriter.finish

    def spy(self: spooled.SpoolWriter, header: str, b64_length: int) -> spooled.SpooledMedia:
        media = finish(self, header, b64_length)
        sizes.append(media.size)
        return media

    monkeypatch.setattr(spooled.SpoolWriter, "finish", spy)
    return sizes


@pytest.fixture(scope="module")
def small_images_gateway(bg, omni):
    """A gateway whose media-limits step downsamples images to MAX_PIXELS."""
    settings = omni_settings(omni, pre=[PolicySpec(name="media-fetch"), PolicySpec(
        name="media-limits", config={"image": {"max_pixels": MAX_PIXELS}})])  # fmt: skip
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def text_only_tokens(omni) -> int:
    """The prompt tokens of the question alone, as the engine counts them."""
    with openai.OpenAI(base_url=omni.base_url, api_key="unused", max_retries=0, timeout=600) as c:
        return ask(c, omni.served_name, TEXT_ONLY).parse().usage.prompt_tokens


def ask(client: openai.OpenAI, model: str, messages: list[dict], **kw):
    """One greedy text-only answer (the thinker alone), as the raw response (its headers, then ``parse()``)."""
    return client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=4, temperature=0, modalities=["text"], **kw
    )


def read_stream(stream) -> tuple[str, str | None, object]:
    """The words, finish_reason and usage of a streamed answer."""
    text, finish, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            assert c.index == 0
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish, usage


def check_answer(via, direct, omni, messages: list[dict], stream: bool) -> int:
    """The answer through the gateway has the OpenAI shape, the engine's own count of the prompt's tokens
    (the same request sent straight to it) and its greedy words; the part went as sent. Its prompt tokens."""
    own = ask(direct, omni.served_name, messages).parse()
    if stream:
        raw = ask(via, MODEL, messages, stream=True, stream_options={"include_usage": True})
        text, finish, usage = read_stream(raw.parse())
    else:
        raw = ask(via, MODEL, messages)
        resp = raw.parse()
        [choice] = resp.choices
        assert resp.object == "chat.completion" and choice.message.audio is None
        text, finish, usage = choice.message.content, choice.finish_reason, resp.usage
    assert "x-omnigate-degraded" not in raw.headers  # nothing rewritten: the client's payload, re-encoded
    assert finish in ("stop", "length") and 0 < usage.completion_tokens <= 4
    assert usage.prompt_tokens == own.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert isinstance(text, str) and text == own.choices[0].message.content
    return usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_spooled_input_audio_reaches_the_engine_whole(via, direct, omni, spooled_sizes, text_only_tokens,
                                                        stream):  # fmt: skip
    part = audio_part(WAV_16K)
    assert len(part["input_audio"]["data"]) > 3 * SPOOL_MIN
    before = _files()
    messages = [{"role": "user", "content": [QUESTION, part]}]
    prompt = check_answer(via, direct, omni, messages, stream)
    assert len(WAV_16K) in spooled_sizes  # the gateway held the payload in its spool, not in the body
    # 13 audio tokens a second, a few either way for the encoder's windows and the audio's start and end.
    assert prompt - text_only_tokens == pytest.approx(13 * AUDIO_S, abs=8)
    assert _gone(before)


@pytest.mark.parametrize("stream", [False, True])
def test_a_spooled_image_data_uri_reaches_the_engine_whole(via, direct, omni, spooled_sizes, text_only_tokens,
                                                           stream):  # fmt: skip
    part = image_part(PNG)
    assert len(part["image_url"]["url"]) > 2 * SPOOL_MIN
    before = _files()
    messages = [{"role": "user", "content": [QUESTION, part]}]
    prompt = check_answer(via, direct, omni, messages, stream)
    assert len(PNG) in spooled_sizes
    assert prompt - text_only_tokens == pytest.approx((IMAGE_SIDE // 32) ** 2, abs=4)
    assert _gone(before)


def test_a_spooled_image_downsampled_by_media_limits_reaches_the_engine_at_its_new_size(
    small_images_gateway, direct, omni, spooled_sizes, text_only_tokens
):
    large = noise_png(*LARGE_IMAGE)  # 2.4 MB
    before = _files()
    messages = [{"role": "user", "content": [QUESTION, image_part(large)]}]
    with openai.OpenAI(base_url=small_images_gateway.url + "/v1", api_key="unused", max_retries=0,
                       timeout=600) as via:  # fmt: skip
        raw = ask(via, MODEL, messages)
    assert "image-downsampled" in raw.headers["x-omnigate-degraded"]
    resp = raw.parse()
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage.completion_tokens > 0
    # The client's PNG, and the smaller one (noise: still over the threshold) the engine's body is made from.
    assert len(spooled_sizes) == 2 and len(large) in spooled_sizes
    # The engine counts the tokens of an image of the size media-limits made (768 at the client's).
    small = noise_png(*target_size(*LARGE_IMAGE, MAX_PIXELS, 1024), seed=1)
    smaller = ask(direct, omni.served_name, [{"role": "user", "content": [QUESTION, image_part(small)]}])
    assert resp.usage.prompt_tokens == smaller.parse().usage.prompt_tokens
    full = ask(direct, omni.served_name, messages).parse()
    assert text_only_tokens < resp.usage.prompt_tokens < full.usage.prompt_tokens / 4
    assert _gone(before)


def test_a_spooled_audio_resampled_by_media_limits_reaches_the_engine_as_long(
    via, direct, omni, spooled_sizes, text_only_tokens
):
    messages = [{"role": "user", "content": [QUESTION, audio_part(WAV_44K)]}]
    before = _files()
    raw = ask(via, MODEL, messages, stream=True, stream_options={"include_usage": True})
    assert "audio-resampled" in raw.headers["x-omnigate-degraded"]
    text, finish, usage = read_stream(raw.parse())
    assert finish in ("stop", "length") and usage.completion_tokens > 0 and text
    assert len(WAV_44K) in spooled_sizes
    # The same seconds at 16 kHz: as many tokens as the engine makes of the client's 44.1 kHz itself.
    own = ask(direct, omni.served_name, messages).parse()
    assert usage.prompt_tokens == own.usage.prompt_tokens
    assert usage.prompt_tokens - text_only_tokens == pytest.approx(13 * AUDIO_S, abs=8)
    assert _gone(before)
