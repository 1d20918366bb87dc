"""Image probing and normalisation on Pillow: headers first, bounded memory, no metadata out.

The header is read before any pixel: an image over the pixel cap is refused
before it is decoded (Pillow's own bomb warning is turned into an error too).
Images over the output caps (2 MP, and a longest side of ``vision_max_res``, 1024 px by
default) are downsampled with the aspect kept; JPEGs
are decoded at a reduced DCT scale first, so a 12 MP photo never needs its full
bitmap. EXIF orientation is applied and every metadata block (EXIF, XMP, ICC,
comments, text chunks) is dropped by re-encoding from pixels.

What the engine gets leaves it no choice of pixels: one frame of 8-bit RGB
(:func:`engine_rgb`: alpha, a palette's or a colour key's transparency composited
onto white, 16-bit samples scaled to 8 bits, CMYK and the rest converted), so the
content screens, which score the forwarded file (:func:`screen_view`), see what
the engine sees. Only an image already in that form (a JPEG, or an 8-bit RGB PNG)
reaches the engine as the client's own bytes, up to its format's end marker: a
file cut before it is refused, text after it (a script or markup polyglot) is
refused, a binary trailer (a phone's gain map or motion clip) is dropped.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import structlog
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from core.errors import InvalidMedia
from policies.media.config import ImageConfig
from policies.media.container import Truncated, check_declared, image_end, is_text

# Pillow warns between MAX_IMAGE_PIXELS and twice that; a warning lets the decode go on, an error stops it.
warnings.simplefilter("error", Image.DecompressionBombWarning)

log = structlog.get_logger(__name__)
_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_ORIENTATION = 0x0112
#: what transparent pixels become: the background vLLM's image loader composites RGBA onto
WHITE = (255, 255, 255)
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_WIDE_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})


@dataclass(slots=True)
class ImageResult:
    data: bytes
    mediatype: str
    source_format: str
    width: int  # as sent to the engine
    height: int
    source_width: int
    source_height: int
    actions: list[str] = field(default_factory=list)


def open_image(data: bytes, cfg: ImageConfig, param: str) -> Image.Image:
    """Open lazily (header only) and enforce the pixel cap before anything is decoded."""
    try:
        im = Image.open(io.BytesIO(data), formats=list(cfg.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidMedia(f"{param}: the image has too many pixels to decode safely", param=param) from None
    except UnidentifiedImageError:
        raise InvalidMedia(
            f"{param}: not an image in a supported format ({', '.join(cfg.formats)})", param=param
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        log.info("media_probe_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the image header is corrupt", param=param) from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise InvalidMedia(f"{param}: the image has no pixels", param=param)
    if w * h > cfg.max_input_pixels:
        raise InvalidMedia(
            f"{param}: the image is {w}x{h} ({w * h:,} pixels); the limit is {cfg.max_input_pixels:,}",
            param=param,
        )
    return im


def _has_metadata(im: Image.Image) -> bool:
    info = im.info
    if any(info.get(k) for k in ("exif", "icc_profile", "xmp", "XML:com.adobe.xmp", "comment", "photoshop")):
        return True
    return bool(getattr(im, "text", None)) if im.format == "PNG" else False


def _out_format(source: str, cfg: ImageConfig) -> str:
    if cfg.output != "auto":
        return cfg.output.upper()
    return "PNG" if source == "PNG" else "JPEG"


def target_size(w: int, h: int, max_pixels: int, max_side: int | None = None) -> tuple[int, int]:
    """The size an image of ``w`` x ``h`` is sent at: within the area cap and the longest-side cap
    (``vision_max_res``), aspect kept, never enlarged."""
    longest = max(w, h)
    over_side = max_side is not None and longest > max_side
    if w * h <= max_pixels and not over_side:
        return w, h
    scale = math.sqrt(max_pixels / (w * h)) if w * h > max_pixels else 1.0
    if max_side is not None:
        scale = min(scale, max_side / longest)
    nw, nh = max(1, int(w * scale)), max(1, int(h * scale))
    if max_side is not None and longest * scale >= max_side - 1:
        # The side cap binds: the longest side lands on it exactly, not a rounding short of it.
        nw, nh = (max_side, nh) if w >= h else (nw, max_side)
    while nw * nh > max_pixels:  # rounding may leave it a pixel row over
        nw, nh = nw - (nw >= nh), nh - (nh > nw)
    return nw, nh


def normalise_image(data: bytes, cfg: ImageConfig, param: str, declared: str | None = None) -> ImageResult:
    """Decode, orient, downsample and strip an image; a 400 naming ``param`` when it cannot be served.

    ``declared`` is the media type the client gave the part; a type naming another format is refused.
    """
    im = open_image(data, cfg, param)
    try:
        check_declared("image", declared, im.format or "unknown", param)
        data, trailer = _cut_trailer(data, im.format or "", param)
        result = _normalise(im, data, cfg, param)
        if trailer:
            result.actions.append("image-trailer-dropped")
        return result
    except InvalidMedia:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidMedia(f"{param}: the image has too many pixels to decode safely", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        log.info("media_decode_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the image is truncated or corrupt", param=param) from None
    finally:
        im.close()


def _cut_trailer(data: bytes, fmt: str, param: str) -> tuple[bytes, bool]:
    """The image's own bytes, up to its end marker, and whether anything followed them."""
    try:
        end = image_end(data, fmt)
    except Truncated:
        raise InvalidMedia(
            f"{param}: the image is truncated (its {fmt} end marker is missing)", param=param
        ) from None
    if end is None or end == len(data):
        return data, False
    trailer = data[end:]
    if is_text(trailer.strip()):
        raise InvalidMedia(
            f"{param}: {len(trailer):,} bytes of text (script or markup) follow the image's end marker",
            param=param,
        )
    return data[:end], True


def _normalise(im: Image.Image, data: bytes, cfg: ImageConfig, param: str) -> ImageResult:
    source = im.format or "unknown"
    sw, sh = im.size
    # Read before anything loads the pixels (a PNG's EXIF lookup does): a PNG's tile names its bit depth.
    canonical = _is_rgb8(im)
    orientation = im.getexif().get(_ORIENTATION, 1)
    out_fmt = _out_format(source, cfg)
    animated = bool(getattr(im, "is_animated", False)) or getattr(im, "n_frames", 1) > 1
    tw, th = target_size(sw, sh, cfg.max_pixels, cfg.vision_max_res)
    resize = (tw, th) != (sw, sh)
    metadata = _has_metadata(im)
    if not (
        resize or metadata or animated or not canonical or orientation not in (0, 1) or out_fmt != source
    ):
        im.load()  # a truncated or corrupt file fails here, before the engine sees it
        return ImageResult(data, _MIME[source], source, sw, sh, sw, sh)

    actions: list[str] = []
    if resize and source == "JPEG":
        # DCT-domain downscale: decodes at 1/2, 1/4 or 1/8 while staying >= the target size.
        im.draft("RGB", (tw, th))  # sizes are in the stored orientation until the transpose below
    im.load()
    alpha = has_alpha(im)
    if orientation not in (0, 1):
        actions.append("image-reoriented")
        if orientation in (5, 6, 7, 8):
            tw, th = th, tw
    if animated:
        actions.append("image-animation-dropped")
    if metadata:
        actions.append("image-metadata-stripped")
    if alpha:
        actions.append("image-alpha-flattened")
    if out_fmt != source or not (canonical or alpha):
        actions.append("image-transcoded")
    im = engine_rgb(im)
    if im.size != (tw, th):
        im = im.resize((tw, th), Image.Resampling.LANCZOS, reducing_gap=3.0)
    if resize:
        actions.append("image-downsampled")
    buf = io.BytesIO()
    if out_fmt == "JPEG":
        im.save(
            buf,
            "JPEG",
            quality=cfg.jpeg_quality,
            optimize=False,
            subsampling="4:2:0" if cfg.jpeg_quality < 95 else "4:4:4",
        )
    elif out_fmt == "PNG":
        im.save(buf, "PNG", compress_level=3)
    else:
        im.save(buf, "WEBP", quality=cfg.jpeg_quality)
    return ImageResult(buf.getvalue(), _MIME[out_fmt], source, im.width, im.height, sw, sh, actions)


def _is_rgb8(im: Image.Image) -> bool:
    """Whether the file is already what the engine is sent: 8-bit RGB, nothing transparent (a PNG's tile
    says ``RGB;16B`` for 16-bit samples, which Pillow and other decoders reduce to 8 bits each their way)."""
    if im.mode != "RGB" or "transparency" in im.info:
        return False
    if im.format != "PNG":
        return True
    return isinstance(im, ImageFile.ImageFile) and all(tile.args == "RGB" for tile in im.tile)


def has_alpha(im: Image.Image) -> bool:
    """An alpha channel, or a palette's or a colour key's transparency (PNG ``tRNS``, GIF)."""
    return im.mode in _ALPHA_MODES or "transparency" in im.info


def engine_rgb(im: Image.Image) -> Image.Image:
    """The loaded frame as the engine is given it: upright (EXIF orientation applied), 8-bit RGB, with
    anything transparent composited onto white (:data:`WHITE`), 16-bit samples scaled to 8 bits rather
    than clipped, and CMYK, palettes and the rest converted by Pillow.

    Engines decode what they get each their own way (vLLM composites RGBA onto white but drops an LA
    image's alpha, a decoder on a black canvas drops it too); an image in this form leaves them none.
    """
    im = ImageOps.exif_transpose(im)
    if im.mode in _WIDE_MODES:
        im = _to_eight_bits(im)
    elif im.mode == "F":
        im = im.convert("L")  # float samples: clipped to 0..255, as Pillow reads them
    if has_alpha(im):
        rgba = im.convert("RGBA")
        flat = Image.new("RGB", rgba.size, WHITE)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return im if im.mode == "RGB" else im.convert("RGB")


def _to_eight_bits(im: Image.Image) -> Image.Image:
    """A 16-bit (or 32-bit integer) greyscale frame as 8-bit ``L``: each sample scaled by 255/65535 (Pillow's
    own conversion clips at 255, which turns most of a 16-bit image white); a colour key becomes alpha."""
    wide = np.asarray(im).astype(np.int64)
    grey = Image.fromarray(np.round(np.clip(wide, 0, 65535) / 257.0).astype(np.uint8), "L")
    key = im.info.get("transparency")
    if isinstance(key, int):
        alpha = Image.fromarray(np.where(wide == key, 0, 255).astype(np.uint8), "L")
        return Image.merge("LA", (grey, alpha))
    return grey


def screen_view(data: bytes, size: tuple[int, int], param: str) -> np.ndarray:
    """What a content screen scores of an image the engine is sent (run in a decoding worker).

    ``data`` is the forwarded file, one frame of 8-bit RGB already (:func:`engine_rgb` is a no-op on it);
    its pixels are resized to ``size`` bilinearly, which is the Open-NSFW model's own first step, so
    the model scores exactly what it would from the full picture while a fraction of it crosses the
    process boundary.
    """
    im = open_image(data, ImageConfig(), param)
    try:
        im.load()
        view = engine_rgb(im).resize(size, Image.Resampling.BILINEAR)
        return np.asarray(view)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidMedia(f"{param}: the image has too many pixels to decode safely", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        log.info("media_decode_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the image is truncated or corrupt", param=param) from None
    finally:
        im.close()
