"""NSFW screening of images and video frames (the packaged Open-NSFW model) and the optional audio screen.

The thresholds here are set between what the real model scores a plain picture
and a shaded skin-tone texture, so the tests exercise the real model and the
policy's decision without shipping explicit material.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from policies.media.models import NSFWModel
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import data_uri, plain_image, png, skin_image, speech, video

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def threshold() -> float:
    """Midway between the model's scores for the plain and the skin-tone picture."""
    model = NSFWModel()
    plain, skin = model.score([plain_image(), skin_image()])
    assert skin > plain * 5, (plain, skin)
    return (plain + skin) / 2


def _serve(bg, upstreams, pre: list[PolicySpec]) -> GatewayServer:
    chain = PolicyChainConfig(pre=[PolicySpec(name="media-fetch"), *pre])
    return GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()


@pytest.fixture(scope="module")
def nsfw_gw(bg, upstreams, threshold):
    server = _serve(
        bg,
        upstreams,
        [PolicySpec(name="media-limits"), PolicySpec(name="nsfw-screen", config={"threshold": threshold})],
    )
    yield server
    server.stop()


def _post(server: GatewayServer, part: dict) -> httpx.Response:
    body = {
        "model": OMNI_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def _image(im) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri("image/png", png(im))}}


def test_flagged_image_is_refused_as_content_policy_violation(nsfw_gw, ups):
    resp = _post(nsfw_gw, _image(skin_image()))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "content_policy_violation"
    assert err["param"] == "messages.0.content.1.image_url.url"
    assert ups.omni_a.request_count == 0


def test_clean_image_passes_and_its_score_is_metered(nsfw_gw, ups):
    assert _post(nsfw_gw, _image(plain_image())).status_code == 200
    metrics = httpx.get(nsfw_gw.url + "/metrics").text
    assert 'omnigate_screen_score_count{policy="nsfw-screen",source="image"}' in metrics


def test_video_frames_are_screened(nsfw_gw, ups):
    skin = np.asarray(skin_image(240).resize((320, 240)))
    blue = np.asarray(plain_image(240).resize((320, 240)))
    flagged = video(8.0, fps=4, frame_fn=lambda i: skin if 12 <= i < 20 else blue)
    clean = video(8.0, fps=4, frame_fn=lambda i: blue)

    def part(clip):
        return {"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}}

    resp = _post(nsfw_gw, part(flagged))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "content_policy_violation"
    assert _post(nsfw_gw, part(clean)).status_code == 200


def test_shadow_mode_records_without_refusing(bg, upstreams, ups, threshold):
    server = _serve(
        bg,
        upstreams,
        [
            PolicySpec(name="media-limits"),
            PolicySpec(name="nsfw-screen", shadow=True, config={"threshold": threshold}),
        ],
    )
    try:
        assert _post(server, _image(skin_image())).status_code == 200
        metrics = httpx.get(server.url + "/metrics").text
        assert (
            'omnigate_policy_decisions_total{policy="nsfw-screen",shadow="true",stage="pre",verdict="reject"} 1.0'
            in metrics
        )
    finally:
        server.stop()


@pytest.fixture(scope="module")
def audio_gw(bg, upstreams):
    server = _serve(
        bg,
        upstreams,
        [
            PolicySpec(name="audio-screen", config={"patterns": [r"credit\s*card\s+numbers?"]}),
            PolicySpec(name="media-limits"),
        ],
    )
    yield server
    server.stop()


def _speech_part(text: str) -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(speech(text)).decode(), "format": "wav"},
    }


def test_audio_screen_refuses_speech_matching_a_pattern(audio_gw, ups):
    resp = _post(audio_gw, _speech_part("Please send me the credit card numbers."))
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (
        err["code"] == "content_policy_violation" and err["param"] == "messages.0.content.1.input_audio.data"
    )
    assert ups.omni_a.request_count == 0


def test_audio_screen_passes_other_speech(audio_gw, ups):
    assert _post(audio_gw, _speech_part("Hello world, this is a test.")).status_code == 200


def test_audio_screen_transcribes_real_speech():
    from policies.audio_screen import AudioScreen, AudioScreenConfig

    screen = AudioScreen(AudioScreenConfig())
    text = screen.transcribe_bytes(speech("Hello world, this is a test."), "p").lower()
    assert "hello" in text and "test" in text
