"""Video probing, 2 fps sampling and re-encoding on PyAV.

The probe reads the container's header only (duration, frame count, size, fps),
after checking that an MP4's sample tables fit the file (FFmpeg sizes its index
from them).
Sampling decodes once, up to the trim point, and converts only the kept frames,
scaled straight to the size the token budget allows (swscale, no full-size RGB
copy). The engine then gets what it accepts: a short H.264 MP4 at the sampling
rate, or the frames as JPEG image parts.
"""

from __future__ import annotations

import io
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
