"""Audio probing and normalisation: libsndfile for headers, PyAV for everything it cannot read.

The duration comes from the container's header (WAV, FLAC, OGG/Vorbis/Opus and
MP3 through libsndfile; AAC/M4A and the rest through PyAV's demuxer), never
from decoding the stream. A WAV header is not trusted: its data size is checked
against the bytes that are really there. Audio that must change (resampled for
the engine, re-framed, cut into segments) is decoded once to 16-bit mono PCM
and written out as FLAC (lossless, half the bytes of WAV) or WAV.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass, field
from typing import Annotated, Literal

import av
import numpy as np
import soundfile as sf
from pydantic import Field

from gateway.audio import wav_header
from gateway.errors import InvalidMedia
from policies.base import PolicyConfig

_SF_CONTAINERS = {"WAV": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3"}
_PASS_MIME = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}


class AudioConfig(PolicyConfig):
    max_duration_s: Annotated[float, Field(gt=0)] = 3 * 3600.0
    segment_s: Annotated[float, Field(ge=10)] = 2400.0
    encoding: Literal["flac", "wav"] = "flac"
    segment_separator: str = "\n\n"


@dataclass(slots=True)
class AudioInfo:
    container: str  # wav | flac | ogg | mp3 | mp4 | aac | ... (what the bytes are, not what they claim)
    duration_s: float
    sample_rate: int
    channels: int
    header_lies: bool = False


@dataclass(slots=True)
class AudioResult:
    info: AudioInfo
    data: bytes  # what segment 0 (or the whole part) is sent as
    mediatype: str
    fmt: str  # wav | flac | ogg | mp3 (for input_audio.format)
    sample_rate: int
    boundaries: list[tuple[float, float]]
    pcm: np.ndarray | None = None  # kept only when the part is segmented
    actions: list[str] = field(default_factory=list)

    def segment(self, i: int, encoding: str) -> bytes:
        assert self.pcm is not None
        start, end = self.boundaries[i]
        return encode_pcm(
            self.pcm[round(start * self.sample_rate) : round(end * self.sample_rate)],
            self.sample_rate,
            encoding,
        )


def _wav_truth(data: bytes) -> tuple[int, int, int] | None:
    """(declared data bytes, present data bytes, block align) of a RIFF/WAVE file, walking its chunks."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, align = 12, 0
    while pos + 8 <= len(data):
        cid = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if cid == b"fmt " and body + 14 <= len(data):
            align = struct.unpack_from("<H", data, body + 12)[0]
        elif cid == b"data":
            return size, len(data) - body, align
        pos = body + size + (size & 1)
    return None


def probe_audio(data: bytes, param: str) -> AudioInfo:
    """Container, duration, rate and channels from headers only; a 400 naming ``param`` if unreadable."""
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        info = None
    if info is not None and info.format in _SF_CONTAINERS and info.samplerate > 0:
        container = _SF_CONTAINERS[info.format]
        frames = info.frames
        lies = False
        if container == "wav":
            truth = _wav_truth(data)
            if truth is not None and truth[2] > 0:
                declared, present, align = truth
                # Chunks after the data are normal; a size beyond the end of the file is a lie.
                lies = declared > present or declared in (0, 0xFFFFFFFF)
                frames = min(declared if declared not in (0, 0xFFFFFFFF) else present, present) // align
        if frames <= 0:
            raise InvalidMedia(f"{param}: the audio holds no samples", param=param)
        return AudioInfo(container, frames / info.samplerate, info.samplerate, info.channels, lies)
    return _probe_av(data, param)


def _probe_av(data: bytes, param: str) -> AudioInfo:
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise InvalidMedia(f"{param}: no audio stream in the file", param=param)
            stream = container.streams.audio[0]
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            if duration is None:
                # Raw streams (ADTS AAC) carry no duration: sum packet durations, still without decoding.
                total = 0
                for packet in container.demux(stream):
                    total += packet.duration or 0
                duration = float(total * stream.time_base) if stream.time_base else 0.0
            name = container.format.name.split(",")[0]
            rate = stream.codec_context.sample_rate or stream.rate or 0
            channels = stream.codec_context.channels or 1
    except InvalidMedia:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        raise InvalidMedia(
            f"{param}: not audio in a supported format ({type(exc).__name__})", param=param
        ) from None
    if not duration or duration <= 0 or rate <= 0:
        raise InvalidMedia(f"{param}: the audio has no duration", param=param)
    return AudioInfo({"mov": "mp4"}.get(name, name), duration, rate, channels)


def decode_pcm(data: bytes, rate: int | None, param: str, max_s: float) -> tuple[np.ndarray, int]:
    """The whole stream as 16-bit mono PCM at ``rate`` (the source's own when None)."""
    chunks: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.audio[0]
            out_rate = rate or stream.codec_context.sample_rate
            resampler = av.AudioResampler(format="s16", layout="mono", rate=out_rate)
            limit = int(max_s * out_rate) + out_rate
            total = 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    arr = out.to_ndarray().reshape(-1)
                    chunks.append(arr)
                    total += arr.size
                if total > limit:
                    raise InvalidMedia(f"{param}: the audio is longer than its header says", param=param)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except InvalidMedia:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        raise InvalidMedia(f"{param}: the audio is corrupt ({type(exc).__name__})", param=param) from None
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    if pcm.size == 0:
        raise InvalidMedia(f"{param}: the audio decodes to no samples", param=param)
    return pcm.astype(np.int16, copy=False), out_rate


def encode_pcm(pcm: np.ndarray, rate: int, encoding: str) -> bytes:
    if encoding == "wav":
        raw = pcm.astype("<i2", copy=False).tobytes()
        return wav_header(rate, 1, len(raw)) + raw
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def split_points(duration: float, segment_s: float) -> list[tuple[float, float]]:
    n = max(1, math.ceil(duration / segment_s - 1e-9))
    return [(i * segment_s, min(duration, (i + 1) * segment_s)) for i in range(n)]


def normalise_audio(data: bytes, cfg: AudioConfig, target_rate: int | None, param: str) -> AudioResult:
    info = probe_audio(data, param)
    if info.duration_s > cfg.max_duration_s:
        raise InvalidMedia(
            f"{param}: the audio lasts {info.duration_s:.0f} s; the limit is {cfg.max_duration_s:.0f} s",
            param=param,
        )
    resample = target_rate is not None and info.sample_rate != target_rate
    split = info.duration_s > cfg.segment_s
    passable = info.container in _PASS_MIME
    if not (resample or split or info.header_lies or not passable):
        return AudioResult(
            info, data, _PASS_MIME[info.container], info.container, info.sample_rate, [(0.0, info.duration_s)]
        )
    pcm, rate = decode_pcm(data, target_rate, param, cfg.max_duration_s)
    duration = pcm.size / rate
    actions: list[str] = []
    if resample:
        actions.append("audio-resampled")
    if info.header_lies:
        actions.append("audio-header-repaired")
    if info.channels > 1:
        actions.append("audio-downmixed")
    if info.container != cfg.encoding:
        actions.append("audio-transcoded")
    bounds = split_points(duration, cfg.segment_s)
    if len(bounds) > 1:
        actions.append("audio-split")
    first = pcm[: round(bounds[0][1] * rate)]
    mediatype = "audio/flac" if cfg.encoding == "flac" else "audio/wav"
    return AudioResult(
        info,
        encode_pcm(first, rate, cfg.encoding),
        mediatype,
        cfg.encoding,
        rate,
        bounds,
        pcm if len(bounds) > 1 else None,
        actions,
    )
