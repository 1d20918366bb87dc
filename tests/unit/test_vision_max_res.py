"""``vision_max_res``: the longest-side cap beside the 2-megapixel area cap, on real generated images."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from pydantic import ValidationError

from policies.media.budget import BudgetConfig, image_tokens
from policies.media.config import AudioConfig, ImageConfig, VideoConfig
from policies.media.image import normalise_image, target_size
from policies.media.parts import MediaRef
from policies.media.process import Settings, probe_part, process_part
from policies.media.targets import MediaTarget
from tests.media import jpeg, photo, png


def _decoded(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_the_deployment_default_is_a_longest_side_of_1024():
    assert ImageConfig().vision_max_res == 1024
    assert ImageConfig(vision_max_res=None).vision_max_res is None
    with pytest.raises(ValidationError):
        ImageConfig(vision_max_res=0)


@pytest.mark.parametrize(
    ("size", "cap", "expected"),
    [
        ((4000, 3000), 1024, (1024, 768)),  # both caps over: the side cap is the tighter
        ((3000, 500), 1024, (1024, 170)),  # 1.5 MP, under the area cap: the side cap alone
        ((500, 3000), 1024, (170, 1024)),  # portrait: the longest side is the height
        ((1000, 800), 1024, (1000, 800)),  # under both: never enlarged
        ((1024, 1024), 1024, (1024, 1024)),  # on the cap: unchanged
        ((4000, 3000), 2048, (1632, 1224)),  # the area cap is the tighter one
        ((4000, 3000), None, (1632, 1224)),  # no side cap: the area cap alone, as before
    ],
)
def test_target_size_keeps_the_aspect_within_both_caps(size, cap, expected):
    w, h = target_size(*size, 2_000_000, cap)
    assert (w, h) == expected
    assert w * h <= 2_000_000
    assert cap is None or max(w, h) <= cap


def test_a_wide_png_under_the_area_cap_is_downsampled_to_the_longest_side():
    wide = png(photo(2400, 600))  # 1.44 MP: the area cap alone would pass it unchanged
    unchanged = normalise_image(wide, ImageConfig(vision_max_res=None), "p")
    assert unchanged.data is wide and unchanged.actions == []

    r = normalise_image(wide, ImageConfig(), "p")
    im = _decoded(r.data)
    assert (im.format, im.size) == ("PNG", (1024, 256))
    assert (r.width, r.height, r.source_width, r.source_height) == (1024, 256, 2400, 600)
    assert r.actions == ["image-downsampled"]


def test_a_configured_cap_applies_after_orientation_on_a_rotated_jpeg():
    shot = jpeg(photo(1600, 1200), orientation=6)  # stored landscape, shown portrait
    r = normalise_image(shot, ImageConfig(vision_max_res=800), "p")
    im = _decoded(r.data)
    assert im.size == (600, 800)  # the longest side (now the height) on the cap, aspect 3:4 kept
    assert set(r.actions) == {"image-downsampled", "image-reoriented", "image-metadata-stripped"}


def test_the_probe_counts_the_tokens_of_the_capped_size():
    """The modal-token budget is checked from headers before a decode: it must see the capped size."""
    cfg = Settings(ImageConfig(vision_max_res=512), AudioConfig(), VideoConfig(), BudgetConfig())
    data = png(photo(2000, 1000))
    ref = MediaRef(0, 1, "image", "image_url", "")
    probed = probe_part(ref, data, cfg, MediaTarget())
    assert probed.tokens == image_tokens(512, 256, cfg.budget)
    done = process_part(ref, data, cfg, MediaTarget(), None, 1 << 30)
    assert done.tokens == probed.tokens
    (part,) = done.parts
    b64 = part.image_url.url.partition(",")[2]
    assert _decoded(base64.b64decode(b64)).size == (512, 256)
