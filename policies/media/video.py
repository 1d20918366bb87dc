"""Video probing, 2 fps sampling and re-encoding on PyAV.

The probe reads the container's header only (duration, frame count, size, fps),
after checking that an MP4's sample tables fit the file (FFmpeg sizes its index
from them).
Sampling decodes once, up to the trim point, and converts only the kept frames,
scaled straight to the size the token budget allows (swscale, no full-size RGB
copy). The engine then gets what it accepts: a short H.264 MP4 at the sampling
rate, or the frames as JPEG image parts. A content screen scores every frame of
the MP4 the engine is sent, or, where that holds more frames than the screen
takes, an MP4 re-encoded from the frames it scored (:func:`screen_video`).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
import structlog
from PIL import Image

from core.errors import InvalidMedia
from policies.media.config import VideoConfig
from policies.media.container import check_isobmff, open_av

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class VideoInfo:
    container: str
    codec: str
    duration_s: float
    frames: int
    fps: float
    width: int
    height: int
    has_audio: bool


@dataclass(slots=True)
class VideoResult:
    info: VideoInfo
    parts: list[tuple[str, bytes]]  # (media type, bytes): one MP4, or one JPEG per frame
    frames: int
    width: int
    height: int
    actions: list[str] = field(default_factory=list)


def probe_video(data: bytes, param: str) -> VideoInfo:
    """Header facts only; nothing is decoded. MP4 sample tables are checked against the bytes first."""
    check_isobmff(data, param)
    try:
        with open_av(data, "video", param) as container:
            if not container.streams.video:
                raise InvalidMedia(f"{param}: no video stream in the file", param=param)
            stream = container.streams.video[0]
            ctx = stream.codec_context
            if ctx is None:
                raise InvalidMedia(f"{param}: no decoder for the file's video codec", param=param)
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            frames = stream.frames or (round(duration * fps) if duration and fps else 0)
            info = VideoInfo(
                container=container.format.name.split(",")[0],
                codec=ctx.name,
                duration_s=duration or 0.0,
                frames=frames,
                fps=fps,
                width=ctx.width,
                height=ctx.height,
                has_audio=bool(container.streams.audio),
            )
    except InvalidMedia:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        log.info("media_probe_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: not a video in a supported format", param=param) from None
    if info.duration_s <= 0 or info.width <= 0 or info.height <= 0:
        raise InvalidMedia(f"{param}: the video has no duration or size in its header", param=param)
    return info


def plan_frames(info: VideoInfo, cfg: VideoConfig) -> tuple[float, int]:
    """(seconds used, frames kept) for a video of ``info`` under ``cfg``; refuses when configured to."""
    used = info.duration_s
    if used > cfg.max_duration_s:
        if cfg.over_limit == "refuse":
            raise InvalidMedia(f"the video lasts {used:.1f} s; the limit is {cfg.max_duration_s:.0f} s")
        used = cfg.max_duration_s
    frames = max(1, min(cfg.max_frames, int(used * cfg.fps + 1e-9) or 1))
    return used, frames


def sample_frames(
    data: bytes,
    used_s: float,
    frames: int,
    fps: float,
    size: tuple[int, int],
    param: str,
    max_decoded: int = 7200,
    stats: dict[str, int] | None = None,
) -> list[np.ndarray]:
    """Decode once up to ``used_s``; keep one frame per 1/fps s, scaled to ``size``, as RGB arrays.

    Decoding stops after ``max_decoded`` frames whatever the timestamps say: a stream whose frames
    all claim the same instant (or go backwards) would otherwise be decoded to its end.
    """
    step = 1.0 / fps
    kept: list[np.ndarray] = []
    next_t = 0.0
    decoded = 0
    try:
        with open_av(data, "video", param) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                decoded += 1
                if decoded > max_decoded:
                    break
                t = frame.time if frame.time is not None else next_t
                if t >= used_s or len(kept) >= frames:
                    break
                if t + 1e-6 < next_t:
                    continue
                kept.append(frame.reformat(width=size[0], height=size[1], format="rgb24").to_ndarray())
                next_t += step
                while next_t <= t:  # a sparse source: never keep two samples for one frame
                    next_t += step
    except (av.FFmpegError, ValueError, OSError) as exc:
        if not kept:
            log.info("media_decode_failed", param=param, error=type(exc).__name__)
            raise InvalidMedia(f"{param}: the video could not be decoded", param=param) from None
    finally:
        if stats is not None:
            stats["decoded"] = min(decoded, max_decoded)
    if not kept:
        raise InvalidMedia(f"{param}: the video has no decodable frames", param=param)
    return kept


def encode_mp4(frames: list[np.ndarray], fps: float, crf: int) -> bytes:
    buf = io.BytesIO()
    h, w = frames[0].shape[:2]
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast", "tune": "fastdecode"}
        for arr in frames:
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def encode_jpeg(arr: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


@dataclass(slots=True)
class ScreenedVideo:
    """What a content screen scores of a video, and what the engine is then sent."""

    #: every frame of the video the engine gets, as the screen's model sees it first
    views: list[np.ndarray]
    #: the video re-encoded to the frames in ``views`` where the one given held more; None: it is sent as is
    video: bytes | None = None


def screen_video(
    data: bytes,
    max_frames: int,
    size: tuple[int, int],
    param: str,
    crf: int,
    max_decoded: int = 7200,
) -> ScreenedVideo:
    """Every frame the engine will decode is scored (run in a decoding worker).

    An engine samples a video with its own rate and frame count, so screening some of its frames
    leaves the others unjudged. A video of at most ``max_frames`` frames is screened whole, as sent;
    a longer one is cut to ``max_frames`` frames spread evenly over it, re-encoded (H.264 at ``crf``,
    the same span of time), and the frames of *that* file, as decoded, are what is scored and what
    the engine gets. Each frame is resized to ``size`` bilinearly, the Open-NSFW model's first step.
    """
    views: list[np.ndarray] = []
    count = 0
    with _decoding(param), open_av(data, "video", param) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate
        for frame in container.decode(stream):
            count += 1
            if count > max_frames:
                views = []  # too many to send as is: counted only, and cut below
            else:
                views.append(_view(frame, size))
            if count >= max_decoded:
                break
    if count == 0:
        raise InvalidMedia(f"{param}: the video has no decodable frames", param=param)
    if count <= max_frames:
        return ScreenedVideo(views)
    keep = spread(count, max_frames)
    kept: list[np.ndarray] = []
    with _decoding(param), open_av(data, "video", param) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in keep:
                kept.append(frame.to_ndarray(format="rgb24"))
            if i + 1 >= count:
                break
    seconds = count / float(rate) if rate else float(count)
    # H.264 in 4:2:0 takes even sides only (the gateway's own videos have them already).
    even = [f[: f.shape[0] // 2 * 2, : f.shape[1] // 2 * 2] for f in kept]
    with _decoding(param):
        cut = encode_mp4(even, len(even) / seconds, crf)
    with _decoding(param), open_av(cut, "video", param) as container:
        views = [_view(frame, size) for frame in container.decode(container.streams.video[0])]
    return ScreenedVideo(views, cut)


def spread(count: int, n: int) -> frozenset[int]:
    """``n`` indices of ``count`` frames, one from the middle of each of ``n`` equal stretches."""
    return frozenset((2 * k + 1) * count // (2 * n) for k in range(min(n, count)))


def _view(frame: av.VideoFrame, size: tuple[int, int]) -> np.ndarray:
    rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))
    return np.asarray(rgb.resize(size, Image.Resampling.BILINEAR))


@contextmanager
def _decoding(param: str) -> Iterator[None]:
    """FFmpeg's errors while a screen decodes the video sent on: a 400 naming the part."""
    try:
        yield
    except (av.FFmpegError, ValueError, OSError) as exc:
        log.info("media_decode_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the video could not be decoded", param=param) from None
