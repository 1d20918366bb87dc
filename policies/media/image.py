"""Image probing and normalisation on Pillow: headers first, bounded memory, no metadata out.

The header is read before any pixel: an image over the pixel cap is refused
before it is decoded (Pillow's own bomb warning is turned into an error too).
Images over the output caps (2 MP, and a longest side of ``vision_max_res``, 1024 px by
default) are downsampled with the aspect kept; JPEGs
are decoded at a reduced DCT scale first, so a 12 MP photo never needs its full
bitmap. EXIF orientation is applied and every metadata block (EXIF, XMP, ICC,
comments, text chunks) is dropped by re-encoding from pixels. An image that
needs none of that reaches the engine as the client's own bytes, up to its
format's end marker: a file cut before it is refused, text after it (a script
or markup polyglot) is refused, a binary trailer (a phone's gain map or motion
clip) is dropped.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, field

import structlog
from PIL import Image, ImageOps, UnidentifiedImageError

from core.errors import InvalidMedia
from policies.media.config import ImageConfig
from policies.media.container import Truncated, check_declared, image_end, is_text

# Pillow warns between MAX_IMAGE_PIXELS and twice that; a warning lets the decode go on, an error stops it.
warnings.simplefilter("error", Image.DecompressionBombWarning)

log = structlog.get_logger(__name__)
_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
_ORIENTATION = 0x0112


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
    orientation = im.getexif().get(_ORIENTATION, 1)
    out_fmt = _out_format(source, cfg)
    animated = bool(getattr(im, "is_animated", False))
    tw, th = target_size(sw, sh, cfg.max_pixels, cfg.vision_max_res)
    resize = (tw, th) != (sw, sh)
    metadata = _has_metadata(im)
    odd_mode = im.mode not in ("RGB", "L", "RGBA", "LA", "P")  # CMYK, 16-bit, float: engines expect 8-bit RGB
    if not (resize or metadata or animated or odd_mode or orientation not in (0, 1) or out_fmt != source):
        im.load()  # a truncated or corrupt file fails here, before the engine sees it
        return ImageResult(data, _MIME[source], source, sw, sh, sw, sh)

    actions: list[str] = []
    if resize and source == "JPEG":
        # DCT-domain downscale: decodes at 1/2, 1/4 or 1/8 while staying >= the target size.
        im.draft("RGB", (tw, th))  # sizes are in the stored orientation until the transpose below
    im.load()
    if orientation not in (0, 1):
        im = ImageOps.exif_transpose(im)
        actions.append("image-reoriented")
        if orientation in (5, 6, 7, 8):
            tw, th = th, tw
    if animated:
        actions.append("image-animation-dropped")
    if metadata:
        actions.append("image-metadata-stripped")
    if out_fmt != source or odd_mode:
        actions.append("image-transcoded")
    im = _to_mode(im, out_fmt)
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


def _to_mode(im: Image.Image, fmt: str) -> Image.Image:
    if fmt == "JPEG":
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            flat = Image.new("RGB", rgba.size, (255, 255, 255))
            flat.paste(rgba, mask=rgba.getchannel("A"))
            return flat
        return im if im.mode in ("RGB", "L") else im.convert("RGB")
    return (
        im
        if im.mode in ("RGB", "RGBA", "L", "LA")
        else im.convert("RGBA" if "transparency" in im.info else "RGB")
    )
