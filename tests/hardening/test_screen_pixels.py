"""The NSFW screen judges exactly the pixels the engine gets, images and video (issue 25).

Every image the gateway forwards is one frame of 8-bit RGB (EXIF orientation applied, alpha composited
onto white, 16-bit scaled to 8), and the screen scores that forwarded file, not the client's. A video
reaches the engine holding only frames the screen scored. Each test sends a real file through a served
gateway (media-fetch, media-limits, nsfw-screen with the packaged Open-NSFW model) to the scripted
engine, then decodes what the engine received and compares it, pixel for pixel, with what the model
was given (the model's first step, a 256x256 bilinear resize, applied to both) and with an oracle the
test computes itself.
"""

from __future__ import annotations

import io

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from policies.media.models import NSFWModel
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.media import (
    alpha_only,
    data_uri,
    decode_data_uri,
    encode,
    frames_file,
    grey16,
    jpeg,
    on_white,
    palette_with_transparency,
    photo,
    plain_image,
    png,
    skin_image,
    video,
)

pytestmark = pytest.mark.timeout(240)

_VIEW = (256, 256)  # the model's own first step resizes to this, bilinear


def _view(pixels: np.ndarray | Image.Image) -> np.ndarray:
    """What the model makes of a picture first: 8-bit RGB resized to 256x256, bilinear."""
    im = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im.resize(_VIEW, resample=Image.Resampling.BILINEAR))


class Scored:
    """Every picture the model is given, in order (the real model still scores them)."""

    def __init__(self) -> None:
        self.views: list[np.ndarray] = []
        self._score = NSFWModel.score

    def install(self, mp: pytest.MonkeyPatch) -> None:
        score = self._score

        def recording(model: NSFWModel, images, batch: int = 4) -> list[float]:
            self.views.extend(_view(im) for im in images)
            return score(model, images, batch)

        mp.setattr(NSFWModel, "score", recording)


@pytest.fixture(scope="module")
def model() -> NSFWModel:
    return NSFWModel()


@pytest.fixture(scope="module")
def threshold(model: NSFWModel) -> float:
    """Between what the model scores the alpha attack as the old screen saw it (a black square) and as
    the engine sees it (the pattern in grey on white); a skin-tone picture is above it, a plain one below."""
    hidden = Image.open(io.BytesIO(alpha_only(skin_image())))
    rgba = np.asarray(hidden)
    black, composited, skin, plain = model.score(
        [
            Image.fromarray(rgba[..., :3]),
            Image.fromarray(on_white(rgba[..., :3], rgba[..., 3])),
            skin_image(),
            plain_image(),
        ]
    )
    assert composited > black * 1.4, (black, composited)
    cut = (black + composited) / 2
    assert skin > cut > plain, (skin, cut, plain)
    return cut


@pytest.fixture(scope="module")
def scored() -> Scored:
    return Scored()


def _serve(bg, upstreams, threshold: float) -> GatewayServer:
    chain = PolicyChainConfig(
        pre=[
            PolicySpec(name="media-fetch"),
            PolicySpec(name="media-limits"),
            PolicySpec(name="nsfw-screen", config={"threshold": threshold}),
        ]
    )
    return GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()


@pytest.fixture(scope="module")
def recording(scored):
    mp = pytest.MonkeyPatch()
    scored.install(mp)
    yield scored
    mp.undo()


@pytest.fixture(scope="module")
def gw(bg, upstreams, threshold, recording):
    """The screen at the attack's threshold (a grey picture scores about as high as the attack)."""
    server = _serve(bg, upstreams, threshold)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lenient(bg, upstreams, recording):
    """The screen at a threshold nothing here reaches: what it scores and what the engine gets."""
    server = _serve(bg, upstreams, 0.999)
    yield server
    server.stop()


def _post(gw: GatewayServer, part: dict) -> httpx.Response:
    body = {
        "model": OMNI_MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
    }
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120)


def _image_part(mediatype: str, data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_uri(mediatype, data)}}


def _sent_parts(ups) -> list[dict]:
    return [
        p
        for m in ups.omni_a.requests[-1]["messages"]
        for p in (m["content"] if isinstance(m["content"], list) else [])
        if p["type"] != "text"
    ]


def _forwarded_image(gw, ups, scored: Scored, mediatype: str, data: bytes) -> np.ndarray:
    """Serve one image; what the engine got, decoded, after checking it is one frame of 8-bit RGB with
    no orientation left to apply and that the screen scored exactly it."""
    scored.views.clear()
    resp = _post(gw, _image_part(mediatype, data))
    assert resp.status_code == 200, resp.text
    (part,) = _sent_parts(ups)
    sent_type, sent = decode_data_uri(part["image_url"]["url"])
    im = Image.open(io.BytesIO(sent))
    assert sent_type == Image.MIME[im.format] and im.format in ("PNG", "JPEG")
    if im.format == "PNG":
        assert im.tile[0].args == "RGB"  # 8 bits a sample (read before anything loads the pixels)
    assert im.mode == "RGB" and "transparency" not in im.info
    assert getattr(im, "n_frames", 1) == 1
    assert im.getexif().get(0x0112) is None
    pixels = np.asarray(im)
    assert len(scored.views) == 1
    assert np.array_equal(scored.views[0], _view(pixels)), (
        "the screen scored other pixels than the engine got"
    )
    return pixels


def _close(a: np.ndarray, b: np.ndarray, mean: float) -> bool:
    """Within a lossy codec's error of each other (JPEG)."""
    return a.shape == b.shape and float(np.abs(a.astype(int) - b.astype(int)).mean()) < mean


# -- images -----------------------------------------------------------------------------------------------------


def test_a_pattern_hidden_in_the_alpha_of_a_black_png_is_refused(gw, ups, scored):
    """The attack: black colour channels, the pattern in alpha. A screen that drops alpha sees black;
    the engine, compositing onto white, sees the pattern. The screen must see what the engine would."""
    scored.views.clear()
    before = ups.omni_a.request_count
    resp = _post(gw, _image_part("image/png", alpha_only(skin_image())))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "content_policy_violation"
    assert err["param"] == "messages.0.content.1.image_url.url"
    assert ups.omni_a.request_count == before
    rgba = np.asarray(Image.open(io.BytesIO(alpha_only(skin_image()))))
    expected = _view(on_white(rgba[..., :3], rgba[..., 3]))
    (view,) = scored.views
    assert int(np.abs(view.astype(int) - expected.astype(int)).max()) <= 1


def test_alpha_is_composited_onto_white_and_the_engine_gets_what_was_screened(lenient, ups, scored):
    w, h = 320, 240
    rgb = np.asarray(photo(w * 4, h * 4).resize((w, h)))
    alpha = np.tile(np.linspace(0, 255, w).astype(np.uint8), (h, 1))
    data = png(Image.fromarray(np.dstack([rgb, alpha]), "RGBA"))
    pixels = _forwarded_image(lenient, ups, scored, "image/png", data)
    assert int(np.abs(pixels.astype(int) - on_white(rgb, alpha).astype(int)).max()) <= 1


def test_a_grey_image_with_alpha_is_composited_onto_white(lenient, ups, scored):
    w, h = 200, 160
    grey = np.full((h, w), 30, np.uint8)
    alpha = np.tile(np.linspace(0, 255, h).astype(np.uint8)[:, None], (1, w))
    data = png(Image.fromarray(np.dstack([grey, alpha]), "LA"))
    pixels = _forwarded_image(lenient, ups, scored, "image/png", data)
    expected = on_white(np.dstack([grey] * 3), alpha)
    assert int(np.abs(pixels.astype(int) - expected.astype(int)).max()) <= 1


def test_palette_transparency_is_composited_onto_white(lenient, ups, scored):
    """Index 0 is transparent; its palette colour (red) must not be what the engine sees there."""
    data, clear = palette_with_transparency()
    pixels = _forwarded_image(lenient, ups, scored, "image/png", data)
    assert (pixels[clear] == 255).all()
    assert (pixels[~clear] == (0, 0, 255)).all()


def test_exif_orientation_is_applied_before_the_screen_and_the_engine(lenient, ups, scored):
    stored = photo(640, 520)
    data = jpeg(stored, quality=95, orientation=6)  # 6: the stored picture is turned 90 degrees clockwise
    pixels = _forwarded_image(lenient, ups, scored, "image/jpeg", data)
    upright = np.asarray(stored.transpose(Image.Transpose.ROTATE_270))
    assert _close(pixels, upright, 4.0)


def test_a_cmyk_jpeg_is_forwarded_as_the_rgb_that_was_screened(lenient, ups, scored):
    rgb = photo(640, 520)
    data = encode(rgb.convert("CMYK"), "JPEG", quality=95)
    pixels = _forwarded_image(lenient, ups, scored, "image/jpeg", data)
    assert _close(pixels, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), 4.0)


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped(lenient, ups, scored):
    data, ramp = grey16()
    pixels = _forwarded_image(lenient, ups, scored, "image/png", data)
    expected = np.round(ramp / 257.0).astype(np.uint8)
    assert int(np.abs(pixels.astype(int) - np.dstack([expected] * 3).astype(int)).max()) <= 1


@pytest.mark.parametrize(
    ("fmt", "mediatype"), [("GIF", "image/gif"), ("PNG", "image/png"), ("TIFF", "image/tiff")]
)
def test_an_animation_or_a_multi_page_file_is_forwarded_as_its_first_frame(
    lenient, ups, scored, fmt, mediatype
):
    data = frames_file(fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.n_frames == 3
        first = np.asarray(im.convert("RGB"))
        im.seek(1)
        second = np.asarray(im.convert("RGB"))
    pixels = _forwarded_image(lenient, ups, scored, mediatype, data)
    assert _close(pixels, first, 4.0) and not _close(pixels, second, 20.0)


# -- video ------------------------------------------------------------------------------------------------------


def _video_views(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        return [_view(f.to_ndarray(format="rgb24")) for f in c.decode(c.streams.video[0])]


@pytest.mark.parametrize("flagged_at", [1, 7, 20, 33])
def test_a_flagged_frame_between_screened_frames_never_reaches_the_engine(gw, ups, scored, flagged_at):
    """40 frames at 2 fps, the engine's own rate (media-limits keeps every one), screened on 16: one
    skin-tone frame among blue ones. Either the request is refused, or the engine's video holds only
    frames the screen scored, one for one, and the skin-tone frame is not among them."""
    skin = np.asarray(skin_image(240).resize((320, 240)))
    blue = np.asarray(plain_image(240).resize((320, 240)))
    clip = video(20.0, fps=2, frame_fn=lambda i: skin if i == flagged_at else blue)
    scored.views.clear()
    before = ups.omni_a.request_count
    resp = _post(gw, {"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}})
    if resp.status_code == 400:
        assert resp.json()["error"]["code"] == "content_policy_violation"
        assert ups.omni_a.request_count == before
        return
    assert resp.status_code == 200, resp.text
    (part,) = _sent_parts(ups)
    sent_type, sent = decode_data_uri(part["video_url"]["url"])
    assert sent_type == "video/mp4"
    forwarded = _video_views(sent)
    assert 1 <= len(forwarded) <= 16
    assert len(forwarded) == len(scored.views)
    for i, (got, screened) in enumerate(zip(forwarded, scored.views, strict=True)):
        assert np.array_equal(got, screened), f"frame {i} of the engine's video was not screened"
    # Blue frames only: the skin-tone frame did not reach the engine.
    for got in forwarded:
        r, _, b = got.reshape(-1, 3).mean(axis=0)
        assert b > r + 50, "a skin-tone frame reached the engine"
    assert "video-cut-to-screened-frames" in resp.headers["x-omnigate-degraded"]


def test_a_cut_video_too_large_for_a_string_reaches_the_engine_as_screened(lenient, ups, scored):
    """A cut of 256 KiB or more goes to the spool as media-limits' outputs do; the engine still gets
    exactly the frames that were scored."""
    rng = np.random.default_rng(7)
    clip = video(
        20.0, fps=2, size=(640, 480), frame_fn=lambda i: rng.integers(0, 255, (480, 640, 3), np.uint8)
    )
    scored.views.clear()
    resp = _post(lenient, {"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}})
    assert resp.status_code == 200, resp.text
    (part,) = _sent_parts(ups)
    _, sent = decode_data_uri(part["video_url"]["url"])
    assert len(sent) >= 256 * 1024
    forwarded = _video_views(sent)
    assert len(forwarded) == len(scored.views) == 16
    assert all(np.array_equal(a, b) for a, b in zip(forwarded, scored.views, strict=True))
