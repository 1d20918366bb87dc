"""Real media made for the tests (Pillow, soundfile, PyAV, espeak-ng), and the servers that hand it out.

``MediaServer`` serves bytes and redirects over real sockets, the way a client's
media host would; ``Canary`` counts every request that reaches it, on 127.0.0.1
and ::1, so an SSRF test can assert that nothing did.
"""

from __future__ import annotations

import base64
import io
import shutil
import socket
import struct
import subprocess
import zlib
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
from aiohttp import web
from PIL import Image, ImageDraw


def data_uri(mediatype: str, data: bytes) -> str:
    return f"data:{mediatype};base64," + base64.b64encode(data).decode()


def decode_data_uri(uri: str) -> tuple[str, bytes]:
    head, _, payload = uri.partition(",")
    return head[5:].split(";")[0], base64.b64decode(payload)


# -- images -----------------------------------------------------------------------------------------------------


def photo(width: int = 4000, height: int = 3000, seed: int = 1) -> Image.Image:
    """A photo-like RGB image: sky gradient, hills, shapes, sensor noise (drawn at 1/4 scale, then upsampled)."""
    rng = np.random.default_rng(seed)
    w, h = width // 4, height // 4
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :]
    sky = np.stack([90 + 80 * y + 0 * x, 140 + 60 * y + 0 * x, 220 - 40 * y + 0 * x], -1)
    ridge = 0.55 + 0.08 * np.sin(x * 9.0) + 0.04 * np.sin(x * 23.0 + 1.3)
    grass = np.stack([60 + 40 * x + 0 * y, 120 + 30 * np.sin(x * 40) + 0 * y, 50 + 0 * x + 0 * y], -1)
    img = np.where((y > ridge)[..., None], grass, sky)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(40):
        cx, cy, r = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(5, w // 12))
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    im = im.resize((width, height), Image.Resampling.BICUBIC)
    noise = Image.effect_noise((width, height), 8).convert("RGB")
    return Image.blend(im, noise, 0.06)


def jpeg(
    im: Image.Image, quality: int = 88, orientation: int | None = None, exif_text: str | None = None
) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    if exif_text is not None:
        exif[0x010E] = exif_text  # ImageDescription
        exif[0x0131] = "test-camera firmware 1.0"  # Software
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, exif=exif.tobytes() if len(exif) else b"")
    return buf.getvalue()


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def png_bomb(width: int = 50_000, height: int = 50_000) -> bytes:
    """A valid PNG header claiming width×height RGB pixels, followed by a tiny IDAT: a decompression bomb."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 4096, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def skin_image(size: int = 400) -> Image.Image:
    """A shaded skin-tone texture: benign, but the Open-NSFW model rates it well above a plain picture."""
    rng = np.random.default_rng(4)
    y, x = np.mgrid[0:size, 0:size] / size
    shade = 0.75 + 0.25 * np.sin(x * 3.1 + 1) * np.cos(y * 2.3)
    base = (230, 160, 130)
    arr = np.stack([np.clip(base[i] * shade + rng.normal(0, 3, (size, size)), 0, 255) for i in range(3)], -1)
    return Image.fromarray(arr.astype(np.uint8))


def plain_image(size: int = 400) -> Image.Image:
    return Image.new("RGB", (size, size), (40, 80, 200))


def encode(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def on_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """What an RGBA picture looks like composited onto white: the oracle for the gateway's flattening."""
    a = alpha.astype(np.float64)[..., None] / 255.0
    return np.round(rgb.astype(np.float64) * a + 255.0 * (1.0 - a)).astype(np.uint8)


def alpha_only(pattern: Image.Image) -> bytes:
    """An RGBA PNG whose colour channels are all black and whose alpha carries ``pattern``: on black (or
    with the alpha dropped) it is a black square; onto white it is ``pattern`` in grey."""
    grey = np.asarray(pattern.convert("L"))
    alpha = (255 - grey).astype(np.uint8)
    rgba = np.dstack([np.zeros_like(alpha)] * 3 + [alpha])
    return png(Image.fromarray(rgba, "RGBA"))


def palette_with_transparency(size: tuple[int, int] = (320, 240)) -> tuple[bytes, np.ndarray]:
    """A P-mode PNG with a tRNS chunk: index 0 (pure red in the palette) is transparent, index 1 is blue.
    Returns the file and the mask of the transparent pixels."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    index = ((xx // 20 + yy // 20) % 2).astype(np.uint8)
    im = Image.fromarray(index, "P")
    im.putpalette([255, 0, 0, 0, 0, 255] + [0, 0, 0] * 254)
    return encode(im, "PNG", transparency=0), index == 0


def grey16(size: tuple[int, int] = (320, 240)) -> tuple[bytes, np.ndarray]:
    """A 16-bit greyscale PNG (Pillow's ``I;16``) of a full-range ramp, and its 16-bit samples."""
    w, h = size
    ramp = np.linspace(0, 65535, w * h).reshape(h, w).astype(np.uint16)
    return encode(Image.fromarray(ramp), "PNG"), ramp


def frames_file(fmt: str, count: int = 3, size: tuple[int, int] = (640, 520)) -> bytes:
    """An animated GIF / APNG or a multi-page TIFF of ``count`` different photo-like frames."""
    frames = [photo(*size, seed=k + 1) for k in range(count)]
    if fmt == "GIF":
        frames = [f.convert("P", palette=Image.Palette.ADAPTIVE) for f in frames]
        return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:])


# -- audio ------------------------------------------------------------------------------------------------------


def tone(seconds: float, rate: int = 16000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)


def wav(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def lying_wav(seconds: float = 5.0, claimed_seconds: float = 2700.0, rate: int = 16000) -> bytes:
    """A WAV whose RIFF and data sizes claim ``claimed_seconds`` while the file holds ``seconds``."""
    blob = bytearray(wav(tone(seconds, rate), rate))
    pos = blob.find(b"data")
    claimed = int(claimed_seconds * rate * 2)
    struct.pack_into("<I", blob, pos + 4, claimed)
    struct.pack_into("<I", blob, 4, claimed + pos + 8 - 8)
    return bytes(blob)


def long_flac(minutes: float = 45.0, rate: int = 8000) -> bytes:
    """``minutes`` of mostly silence with a click each minute, as FLAC (small on the wire, long in time)."""
    pcm = np.zeros(int(minutes * 60 * rate), np.int16)
    pcm[:: rate * 60] = 3000
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="FLAC")
    return buf.getvalue()


def hostile_flac(seconds: float = 2460.0, rate: int = 96000) -> bytes:
    """A small FLAC that declares a long stream at a high rate: silence with a click each second.

    Written a minute at a time, so making it never holds the samples it declares."""
    buf = io.BytesIO()
    minute = np.zeros(rate * 60, np.int16)
    minute[::rate] = 3000
    with sf.SoundFile(buf, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
        left = int(seconds * rate)
        while left > 0:
            f.write(minute[: min(left, minute.size)])
            left -= minute.size
    return buf.getvalue()


def speech(text: str, rate: int = 16000) -> bytes:
    """Real speech from espeak-ng (a test-only tool), as 16-bit WAV at ``rate``."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("the audio-screen tests need espeak-ng (apt-get install -y espeak-ng)")
    raw = subprocess.run(
        [exe, "--stdout", "-s", "150", text], capture_output=True, check=True, timeout=60
    ).stdout
    with av.open(io.BytesIO(raw)) as c:
        frames = [f for f in c.decode(audio=0)]
    resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
    out = [r.to_ndarray().reshape(-1) for f in frames for r in resampler.resample(f)]
    out += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return wav(np.concatenate(out), rate)


# -- video ------------------------------------------------------------------------------------------------------


def video(
    seconds: float, fps: int = 4, size: tuple[int, int] = (320, 240), frame_fn=None, audio: bool = False
) -> bytes:
    """An H.264 MP4 of moving shapes (``frame_fn(i) -> RGB array`` overrides the picture)."""
    w, h = size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=Fraction(fps))
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        vs.options = {"preset": "ultrafast"}
        astream = out.add_stream("aac", rate=16000) if audio else None
        n = int(seconds * fps)
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(n):
            if frame_fn is not None:
                arr = frame_fn(i)
            else:
                cx = (i * 7) % w
                arr = np.zeros((h, w, 3), np.uint8)
                arr[..., 2] = 120
                arr[(xx - cx) ** 2 + (yy - h // 2) ** 2 < 900] = (250, 220, 40)
            for p in vs.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(p)
        for p in vs.encode(None):
            out.mux(p)
        if astream is not None:
            samples = int(seconds * 16000)
            for start in range(0, samples, 1024):
                frame = av.AudioFrame.from_ndarray(
                    np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
                )
                frame.sample_rate, frame.pts = 16000, start
                for p in astream.encode(frame):
                    out.mux(p)
            for p in astream.encode(None):
                out.mux(p)
    return buf.getvalue()


def lying_video(frames: int = 8000, last_s: float = 119.0, rate: int = 6000) -> bytes:
    """An H.264 MP4 whose timestamps lie: ``frames - 1`` frames 1/``rate`` s apart, then one at ``last_s``.

    The header then says the video lasts ``last_s`` seconds, so a sampler planning 2 fps over it walks
    thousands of frames that all claim to fall in its first second or so.
    """
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=Fraction(rate))
        vs.width, vs.height, vs.pix_fmt = 64, 64, "yuv420p"
        vs.codec_context.time_base = Fraction(1, rate)
        vs.options = {"preset": "ultrafast", "bf": "0"}  # no B-frames: decode order is pts order
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), i % 255, np.uint8), format="rgb24")
            frame.pts = i if i < frames - 1 else int(last_s * rate)
            frame.time_base = Fraction(1, rate)
            for p in vs.encode(frame):
                out.mux(p)
        for p in vs.encode(None):
            out.mux(p)
    return buf.getvalue()


def video_facts(data: bytes) -> tuple[int, float, int, int]:
    """(decoded frame count, duration s, width, height) of a video, by decoding it."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        frames = list(c.decode(s))
        duration = float(s.duration * s.time_base) if s.duration else 0.0
        return len(frames), duration, frames[0].width, frames[0].height


# -- servers ----------------------------------------------------------------------------------------------------


class MediaServer:
    """Serves registered bytes at /m/{name}; /redirect?to=URL answers 302; /loop redirects to itself."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, bytes]] = {}
        self.hits: list[str] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def add(self, name: str, content_type: str, data: bytes) -> str:
        self.files[name] = (content_type, data)
        return f"{self.base}/m/{name}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> MediaServer:
        app = web.Application()
        app.router.add_get("/m/{name}", self._file)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/loop", self._loop)
        app.router.add_get("/endless", self._endless)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _file(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        name = request.match_info["name"]
        if name not in self.files:
            return web.Response(status=404)
        ctype, data = self.files[name]
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def _redirect(self, request: web.Request) -> web.Response:
        self.hits.append(request.path_qs)
        return web.Response(status=302, headers={"Location": request.query["to"]})

    async def _loop(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        return web.Response(status=302, headers={"Location": "/loop"})

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        """A body that never ends and declares a small Content-Length it then exceeds."""
        self.hits.append(request.path)
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        try:
            for _ in range(100_000):
                await resp.write(b"\0" * 65536)
        except (ConnectionResetError, RuntimeError):
            pass
        return resp


class Canary:
    """An HTTP server on 127.0.0.1 and ::1 (same port) that records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.ipv6 = False

    async def start(self) -> Canary:
        async def record(request: web.Request) -> web.Response:
            self.requests.append(f"{request.host}{request.path_qs}")
            return web.Response(body=png(plain_image(8)), headers={"Content-Type": "image/png"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if socket.has_ipv6:
            try:
                await web.TCPSite(self._runner, "::1", self.port).start()
                self.ipv6 = True
            except OSError:
                self.ipv6 = False
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
