"""Media limits and normalisation end to end: real files in, what the engine really receives checked upstream."""

from __future__ import annotations

import base64
import io
import zipfile

import httpx
import pytest
import soundfile as sf
from PIL import Image
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import (
    MediaServer,
    data_uri,
    decode_data_uri,
    jpeg,
    lying_wav,
    photo,
    plain_image,
    png,
    png_bomb,
    tone,
    video,
    video_facts,
    wav,
)
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)


def _chain(media_port: int, **limits) -> PolicyChainConfig:
    return PolicyChainConfig(
        pre=[
            PolicySpec(name="request-limits"),
            PolicySpec(name="media-fetch", config={"internal_hosts": [f"127.0.0.1:{media_port}"]}),
            PolicySpec(name="media-limits", config=limits),
        ]
    )


@pytest.fixture(scope="module")
def media(bg):
    server = bg.run(MediaServer().start())
    yield server
    bg.run(server.stop())


@pytest.fixture(scope="module")
def gw(bg, upstreams, media):
    server = GatewayServer(bg, gateway_settings(upstreams, _chain(media.port)), CollectorRegistry()).start()
    yield server
    server.stop()


@pytest.fixture
def make_gw(bg, upstreams, media):
    servers: list[GatewayServer] = []

    def _make(settings: Settings | None = None, **limits) -> GatewayServer:
        s = settings or gateway_settings(upstreams, _chain(media.port, **limits))
        server = GatewayServer(bg, s, CollectorRegistry()).start()
        servers.append(server)
        return server

    yield _make
    for s in servers:
        s.stop()


def _post(server: GatewayServer, parts: list[dict], model: str = OMNI_MODEL, **extra) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}],
        **extra,
    }
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _sent_parts(upstream, i: int = -1) -> list[dict]:
    return [
        p
        for m in upstream.requests[i]["messages"]
        for p in (m["content"] if isinstance(m["content"], list) else [])
    ]


def _err(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- images -----------------------------------------------------------------------------------------------------


def test_12mp_photo_is_downsampled_to_the_longest_side_reoriented_and_stripped(gw, ups):
    shot = jpeg(photo(4000, 3000), orientation=6, exif_text="GPS 52.37N 4.89E, owner Jane Doe")
    resp = _post(gw, [_image(data_uri("image/jpeg", shot))])
    assert resp.status_code == 200, resp.text
    assert set(resp.headers["x-omnigate-degraded"].split(",")) == {
        "image-reoriented",
        "image-metadata-stripped",
        "image-downsampled",
    }
    im, data = _sent_image(ups.omni_a)
    assert im.format == "JPEG"
    # vision_max_res (1024 by default) is tighter than the 2 MP cap for a 4:3 photo: 768x1024.
    assert im.size == (768, 1024)  # orientation 6 applied: the 4000x3000 sensor image is a portrait
    assert len(im.getexif()) == 0 and "exif" not in im.info
    assert b"Jane Doe" not in data


def _sent_image(upstream) -> tuple[Image.Image, bytes]:
    (sent,) = [p for p in _sent_parts(upstream) if p["type"] == "image_url"]
    mediatype, data = decode_data_uri(sent["image_url"]["url"])
    im = Image.open(io.BytesIO(data))
    assert mediatype == Image.MIME[im.format]
    return im, data


def test_without_a_longest_side_cap_the_2mp_area_cap_alone_applies(make_gw, upstreams):
    upstreams.reset()
    server = make_gw(image={"vision_max_res": None})
    resp = _post(server, [_image(data_uri("image/jpeg", jpeg(photo(4000, 3000))))])
    assert resp.status_code == 200, resp.text
    im, _ = _sent_image(upstreams.omni_a)
    assert 1_900_000 < im.width * im.height <= 2_000_000  # downsampled to the cap, not far below it
    assert abs(im.width / im.height - 4 / 3) < 0.01  # aspect kept
    assert max(im.size) > 1024


def test_a_panorama_under_the_area_cap_is_cut_to_the_longest_side(gw, ups):
    wide = png(photo(3200, 400))  # 1.28 MP: within 2 MP, but 3,200 px wide
    resp = _post(gw, [_image(data_uri("image/png", wide))])
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-omnigate-degraded"] == "image-downsampled"
    im, _ = _sent_image(ups.omni_a)
    assert (im.format, im.size) == ("PNG", (1024, 128))


def test_a_tenant_policy_set_sets_its_own_longest_side(make_gw, upstreams, media):
    from gateway.tenants import mint_key

    key = mint_key()
    wide_chain = _chain(media.port, image={"vision_max_res": 1600})
    settings = gateway_settings(
        upstreams,
        _chain(media.port),
        policy_sets={"wide": wide_chain},
        tenants=[{"name": "wide-tenant", "policy_set": "wide"}, {"name": "plain-tenant"}],
        api_keys=[{"id": key.id, "tenant": "wide-tenant", "sha256": key.sha256}],
    )
    upstreams.reset()
    server = make_gw(settings)
    body = {
        "model": OMNI_MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    _image(data_uri("image/jpeg", jpeg(photo(4000, 3000)))),
                ],
            }
        ],
    }
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"authorization": f"Bearer {key.key}"},
    )
    assert resp.status_code == 200, resp.text
    im, _ = _sent_image(upstreams.omni_a)
    # The tenant's 1,600 px: looser than the default 1,024, tighter than the 2 MP cap's 1632x1224.
    assert im.size == (1600, 1200)


def test_small_clean_image_reaches_the_engine_as_sent(gw, ups):
    original = png(plain_image(300))
    resp = _post(gw, [_image(data_uri("image/png", original))])
    assert resp.status_code == 200
    assert "x-omnigate-degraded" not in resp.headers
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "image_url"]
    assert decode_data_uri(sent["image_url"]["url"]) == ("image/png", original)


@pytest.mark.parametrize("size", [(50_000, 50_000), (9_000, 9_000)])
def test_pixel_bomb_header_is_refused_before_decoding(gw, ups, size):
    resp = _post(gw, [_image(data_uri("image/png", png_bomb(*size)))])
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "invalid_media"
    assert err["param"] == "messages.0.content.1.image_url.url"
    assert "pixels" in err["message"]
    assert ups.omni_a.request_count == 0


def test_truncated_jpeg_is_refused_naming_the_part(gw, ups):
    whole = jpeg(photo(800, 600))
    resp = _post(gw, [_image(data_uri("image/jpeg", whole[: len(whole) // 2]))])
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "invalid_media" and "truncated" in err["message"]
    assert err["param"] == "messages.0.content.1.image_url.url"


def test_extension_and_content_type_that_lie_are_ignored(gw, ups, media):
    """A JPEG served as photo.png with Content-Type image/png is read as the JPEG it is."""
    url = media.add("photo.png", "image/png", jpeg(photo(640, 480)))
    resp = _post(gw, [_image(url)])
    assert resp.status_code == 200, resp.text
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "image_url"]
    mediatype, data = decode_data_uri(sent["image_url"]["url"])
    assert mediatype == "image/jpeg" and Image.open(io.BytesIO(data)).format == "JPEG"


def test_a_data_uri_declaring_another_format_is_refused(gw, ups):
    """The client wrote the type itself: a mismatch is refused; octet-stream declares nothing."""
    photo_bytes = jpeg(photo(640, 480))
    resp = _post(gw, [_image(data_uri("image/png", photo_bytes))])
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "invalid_media" and err["param"] == "messages.0.content.1.image_url.url"
    assert "declares image/png but the bytes are a JPEG image" in err["message"]
    assert ups.omni_a.request_count == 0
    assert _post(gw, [_image(data_uri("application/octet-stream", photo_bytes))]).status_code == 200


def test_an_image_that_is_also_a_zip_archive_is_refused(gw, ups):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("payload.sh", "#!/bin/sh\n")
    resp = _post(gw, [_image(data_uri("image/jpeg", jpeg(photo(320, 240)) + buf.getvalue()))])
    assert resp.status_code == 400
    assert "also a ZIP archive" in _err(resp)["message"]
    assert ups.omni_a.request_count == 0


def test_audio_posing_as_an_image_is_refused(gw, ups, media):
    url = media.add("cat.jpg", "image/jpeg", wav(tone(1.0), 16000))
    resp = _post(gw, [_image(url)])
    assert resp.status_code == 400
    assert "not an image" in _err(resp)["message"]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (_image("data:image/png;base64,@@@not-base64@@@"), "messages.0.content.1.image_url.url"),
        (_image("data:image/png;base64,iVBORw0KGgo"), "messages.0.content.1.image_url.url"),  # bad padding
        (_image("data:image/png,rawbytes"), "messages.0.content.1.image_url.url"),  # not base64
        (_image("data:image/png;base64"), "messages.0.content.1.image_url.url"),  # no comma
        (_image("data:;;;;base64,AAAA"), "messages.0.content.1.image_url.url"),
        (
            {"type": "input_audio", "input_audio": {"data": "%%%%", "format": "wav"}},
            "messages.0.content.1.input_audio.data",
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAA="}},
            "messages.0.content.1.video_url.url",
        ),
    ],
)
def test_malformed_data_uris_and_base64_are_400s_naming_the_part(gw, ups, part, param):
    resp = _post(gw, [part])
    assert resp.status_code == 400, resp.text
    err = _err(resp)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert ups.omni_a.request_count == 0


# -- audio ------------------------------------------------------------------------------------------------------


def _audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_wav_header_lying_about_its_length_is_served_with_the_true_length(gw, ups):
    resp = _post(gw, [_audio_part(lying_wav(seconds=5.0, claimed_seconds=2700.0))])
    assert resp.status_code == 200, resp.text
    assert "audio-header-repaired" in resp.headers["x-omnigate-degraded"]
    assert ups.omni_a.request_count == 1  # 5 s of audio: no segmentation although the header claims 45 min
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "input_audio"]
    pcm, rate = sf.read(io.BytesIO(base64.b64decode(sent["input_audio"]["data"])), dtype="int16")
    assert rate == 16000 and abs(len(pcm) / rate - 5.0) < 0.01


def test_audio_is_resampled_for_the_engine(gw, ups):
    resp = _post(gw, [_audio_part(wav(tone(3.0, 44100), 44100))])
    assert resp.status_code == 200
    assert "audio-resampled" in resp.headers["x-omnigate-degraded"]
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "input_audio"]
    assert sent["input_audio"]["format"] == "wav"  # what OpenAI's schema, and so vLLM's, takes
    pcm, rate = sf.read(io.BytesIO(base64.b64decode(sent["input_audio"]["data"])), dtype="int16")
    assert rate == 16000 and abs(len(pcm) / rate - 3.0) < 0.01


def test_audio_at_the_engine_rate_passes_unchanged(gw, ups):
    original = wav(tone(2.0, 16000), 16000)
    resp = _post(gw, [_audio_part(original)])
    assert resp.status_code == 200 and "x-omnigate-degraded" not in resp.headers
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "input_audio"]
    assert base64.b64decode(sent["input_audio"]["data"]) == original


# -- video ------------------------------------------------------------------------------------------------------


def test_150s_video_is_trimmed_to_120s_at_2fps(gw, ups):
    clip = video(150.0, fps=4, audio=True)
    resp = _post(gw, [{"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}}])
    assert resp.status_code == 200, resp.text
    assert set(resp.headers["x-omnigate-degraded"].split(",")) == {
        "video-trimmed",
        "video-resampled",
        "video-audio-dropped",
    }
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "video_url"]
    mediatype, data = decode_data_uri(sent["video_url"]["url"])
    frames, duration, _, _ = video_facts(data)
    assert mediatype == "video/mp4"
    assert frames == 240 and abs(duration - 120.0) < 0.6


def test_150s_video_is_refused_when_configured(make_gw, ups):
    server = make_gw(video={"over_limit": "refuse"})
    resp = _post(
        server, [{"type": "video_url", "video_url": {"url": data_uri("video/mp4", video(150.0, fps=2))}}]
    )
    assert resp.status_code == 400
    err = _err(resp)
    assert err["param"] == "messages.0.content.1.video_url.url"
    assert "150" in err["message"] and "120" in err["message"]


def test_frames_engines_get_sampled_frames_as_images(make_gw, upstreams, media):
    settings = Settings(
        engines=[
            EngineConfig(
                name="vl",
                kind="vllm",
                base_url=upstreams.vllm.base_url,
                model="scripted",
                serves=[TEXT_MODEL],
                input_modalities=["text", "image", "video"],
                video_input="frames",
            )
        ],
        policies=_chain(media.port),
        logging={"level": "warning"},
    )
    upstreams.reset()
    server = make_gw(settings)
    resp = _post(
        server,
        [{"type": "video_url", "video_url": {"url": data_uri("video/mp4", video(10.0, fps=8))}}],
        model=TEXT_MODEL,
    )
    assert resp.status_code == 200, resp.text
    assert "video-as-frames" in resp.headers["x-omnigate-degraded"]
    images = [p for p in _sent_parts(upstreams.vllm) if p["type"] == "image_url"]
    assert len(images) == 20  # 10 s at 2 fps
    assert not [p for p in _sent_parts(upstreams.vllm) if p["type"] == "video_url"]
    assert Image.open(io.BytesIO(decode_data_uri(images[0]["image_url"]["url"])[1])).format == "JPEG"


# -- request rules ----------------------------------------------------------------------------------------------


def test_message_with_two_modalities_is_split(gw, ups):
    img = _image(data_uri("image/png", png(plain_image(64))))
    resp = _post(gw, [img, _audio_part(wav(tone(1.0), 16000)), {"type": "text", "text": "and this?"}])
    assert resp.status_code == 200, resp.text
    assert "message-split" in resp.headers["x-omnigate-degraded"]
    sent = ups.omni_a.requests[-1]["messages"]
    assert [[p["type"] for p in m["content"]] for m in sent] == [
        ["text", "image_url"],
        ["input_audio", "text"],
    ]
    assert all(m["role"] == "user" for m in sent)


def test_message_with_two_modalities_is_refused_when_configured(make_gw, ups):
    server = make_gw(one_modality_per_message="refuse")
    img = _image(data_uri("image/png", png(plain_image(64))))
    resp = _post(server, [img, _audio_part(wav(tone(1.0), 16000))])
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "one_modality_per_message" and err["param"] == "messages.0.content"
    assert "audio and image" in err["message"]


def test_modal_budget_names_the_part_and_the_excess(gw, ups):
    big = _image(
        data_uri("image/jpeg", jpeg(photo(1024, 768)))
    )  # on the 1024 px cap: about 1,000 tokens each
    resp = _post(gw, [big] * 17)
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "modal_budget_exceeded"
    assert err["param"].startswith("messages.0.content.")
    assert "over the limit of 16,384" in err["message"]
    assert ups.omni_a.request_count == 0


def test_engine_context_is_checked(make_gw, upstreams, media):
    settings = gateway_settings(upstreams, _chain(media.port))
    settings.engines[0] = settings.engines[0].model_copy(update={"max_context_tokens": 4096})
    settings.engines[1] = settings.engines[1].model_copy(update={"max_context_tokens": 4096})
    upstreams.reset()
    server = make_gw(settings)
    big = _image(data_uri("image/jpeg", jpeg(photo(1600, 1200))))  # sent at 1024x768: about 1,000 tokens
    resp = _post(server, [big], max_tokens=3200)
    assert resp.status_code == 400
    err = _err(resp)
    assert err["code"] == "context_length_exceeded"
    assert "4,096" in err["message"] and err["param"] == "messages.0.content.1"


def test_metrics_count_parts_and_degradations(gw, ups):
    _post(gw, [_image(data_uri("image/jpeg", jpeg(photo(2000, 1500))))])
    text = httpx.get(gw.url + "/metrics").text
    assert 'omnigate_media_parts_total{kind="image",outcome="rewritten"}' in text
    assert 'omnigate_degradations_total{reason="image-downsampled"}' in text
    assert "omnigate_media_processing_seconds_count" in text


def test_chain_without_media_fetch_before_media_limits_fails_the_boot(upstreams):
    from policies.registry import PolicyConfigError, build_chain

    with pytest.raises(PolicyConfigError, match="needs 'media-fetch' earlier"):
        build_chain(PolicyChainConfig(pre=[PolicySpec(name="media-limits"), PolicySpec(name="media-fetch")]))
    with pytest.raises(PolicyConfigError, match="fixed step of every chain and cannot run in shadow mode"):
        build_chain(
            PolicyChainConfig(
                pre=[PolicySpec(name="media-fetch", shadow=True), PolicySpec(name="media-limits")]
            )
        )


def test_upstream_script_still_answers(gw, ups):
    ups.omni_a.default = Script(flavour="omni", text="ok")
    resp = _post(gw, [])
    assert resp.status_code == 200


@pytest.mark.parametrize(
    ("make", "fmt"),
    [
        (lambda: _encode(Image.new("CMYK", (120, 90), (10, 20, 30, 0)), "JPEG"), "JPEG"),
        (lambda: _encode(Image.new("RGB", (120, 90), (200, 10, 10)), "GIF"), "JPEG"),
        (lambda: _encode(Image.new("RGB", (120, 90), (200, 10, 10)), "BMP"), "JPEG"),
    ],
)
def test_formats_are_normalised_to_what_engines_take(gw, ups, make, fmt):
    resp = _post(gw, [_image(data_uri("application/octet-stream", make()))])
    assert resp.status_code == 200, resp.text
    assert "image-transcoded" in resp.headers["x-omnigate-degraded"]
    (sent,) = [p for p in _sent_parts(ups.omni_a) if p["type"] == "image_url"]
    im = Image.open(io.BytesIO(decode_data_uri(sent["image_url"]["url"])[1]))
    assert im.format == fmt and im.mode == "RGB"


def _encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()
