"""Audio probing and normalisation: libsndfile for headers, PyAV for everything it cannot read.

The duration comes from the container's header (WAV, FLAC, OGG/Vorbis/Opus and
MP3 through libsndfile; AAC/M4A and the rest through PyAV's demuxer), never
from decoding the stream. Headers are not trusted: a WAV's data size is checked
against the bytes that are really there (and its claim against the duration
limit), a FLAC must read to the sample count its header declares, an M4A's
sample tables must fit the file. Audio that must change (resampled for
the engine, re-framed, cut into segments) is decoded once to 16-bit mono PCM
and written out as FLAC (lossless, half the bytes of WAV) or WAV.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass, field

import av
import numpy as np
import soundfile as sf
import structlog

from core.audio import wav_header
from core.errors import InvalidMedia, MediaTooLarge
from policies.media.config import AudioConfig
from policies.media.container import check_declared, check_isobmff, open_av

log = structlog.get_logger(__name__)
_SF_CONTAINERS = {"WAV": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3"}
_PASS_MIME = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}
#: Data sizes that streaming writers put in a header they cannot seek back to: FFmpeg writes 0xFFFFFFFF,
#: SoX 0x7FFFF000; they say "unknown", not "this long".
_UNKNOWN_SIZES = frozenset({0, 0x7FFFF000, 0x7FFFFFFF, 0xFFFFFFFF})
#: WAVE format tags whose sample frames are channels x bytes per sample: PCM, IEEE float, A-law, mu-law,
#: extensible.
_PCM_TAGS = frozenset({1, 3, 6, 7, 0xFFFE})


@dataclass(slots=True)
class AudioInfo:
    container: str  # wav | flac | ogg | mp3 | mp4 | aac | ... (what the bytes are, not what they claim)
    duration_s: float
    sample_rate: int
    channels: int
    header_lies: bool = False
    declared_s: float | None = None  # what a WAV header claims, when it claims more than the file holds


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


@dataclass(frozen=True, slots=True)
class _WavHeader:
    declared: int | None  # data bytes the header claims; None for a streaming writer's placeholder
    present: int  # data bytes really there
    frame_bytes: int  # bytes per sample frame for PCM-like tags, else 0 (libsndfile counts the frames)
    consistent: bool  # the fmt chunk's block align agrees with its channels and sample width


def _wav_header(data: bytes) -> _WavHeader | None:
    """Walk a RIFF/WAVE file's chunks to its data chunk; None when it is not one."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, tag, channels, align, bits = 12, 0, 0, 0, 0
    while pos + 8 <= len(data):
        cid = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if cid == b"fmt " and body + 16 <= len(data):
            tag, channels, _, _, align, bits = struct.unpack_from("<HHIIHH", data, body)
        elif cid == b"data":
            pcm = tag in _PCM_TAGS
            frame = channels * ((bits + 7) // 8) if pcm else 0
            return _WavHeader(
                None if size in _UNKNOWN_SIZES else size,
                len(data) - body,
                frame,
                align > 0 and (not pcm or align == frame),
            )
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
        declared_s = None
        if container == "wav":
            wav = _wav_header(data)
            if wav is not None:
                # Chunks after the data are normal; a size beyond the end of the file, a placeholder or a
                # block align that contradicts the format is a header to rewrite.
                lies = wav.declared is None or wav.declared > wav.present or not wav.consistent
                if wav.frame_bytes > 0:
                    frames = min(wav.present, wav.declared or wav.present) // wav.frame_bytes
                    if wav.declared is not None and wav.declared > wav.present:
                        declared_s = wav.declared / wav.frame_bytes / info.samplerate
        if frames <= 0:
            raise InvalidMedia(f"{param}: the audio holds no samples", param=param)
        if container == "flac" and not _reads_to_the_end(data):
            raise InvalidMedia(
                f"{param}: the FLAC stream ends before the {frames:,} samples its header declares "
                "(truncated)",
                param=param,
            )
        return AudioInfo(
            container, frames / info.samplerate, info.samplerate, info.channels, lies, declared_s
        )
    return _probe_av(data, param)


def _reads_to_the_end(data: bytes, tail: int = 256) -> bool:
    """Whether the last samples the header counts are there: one seek and a short read, no full decode."""
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            want = min(tail, f.frames)
            f.seek(f.frames - want)
            return bool(len(f.read(want, dtype="int16")) == want)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return False


def _probe_av(data: bytes, param: str) -> AudioInfo:
    check_isobmff(data, param)
    try:
        with open_av(data, "audio", param) as container:
            if not container.streams.audio:
                raise InvalidMedia(f"{param}: no audio stream in the file", param=param)
            stream = container.streams.audio[0]
            if stream.codec_context is None:
                raise InvalidMedia(f"{param}: no decoder for the file's audio codec", param=param)
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
        log.info("media_probe_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: not audio in a supported format", param=param) from None
    if not duration or duration <= 0 or rate <= 0:
        raise InvalidMedia(f"{param}: the audio has no duration", param=param)
    return AudioInfo({"mov": "mp4"}.get(name, name), duration, rate, channels)


def decode_pcm(
    data: bytes, rate: int, param: str, max_s: float, max_bytes: int | None = None
) -> tuple[np.ndarray, int]:
    """The whole stream as 16-bit mono PCM, resampled to ``rate`` frame by frame as it decodes.

    The source-rate samples are never held whole: each decoded frame is resampled and copied into
    one buffer sized for ``max_s`` at the output rate (or ``max_bytes``, the request's room, if less),
    and a stream that runs past it is refused.
    """
    cap = int(max_s * rate) + rate
    if max_bytes is not None and max_bytes // 2 < cap:
        cap = max_bytes // 2
    # One buffer at the bound: the kernel maps its pages only as samples are written, so an honest
    # header costs what it decodes to, a lying one at most the cap, and nothing is copied to grow.
    pcm = np.empty(cap, np.int16)
    total = 0
    try:
        with open_av(data, "audio", param) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)

            def put(frames: list[av.AudioFrame]) -> None:
                nonlocal total
                for out in frames:
                    arr = out.to_ndarray().reshape(-1)
                    if total + arr.size > cap:
                        if max_bytes is not None and cap == max_bytes // 2:
                            raise MediaTooLarge(
                                f"{param}: the decoded audio exceeds the {max_bytes:,} bytes the request may "
                                "still hold",
                                param=param,
                            )
                        raise InvalidMedia(f"{param}: the audio is longer than its header says", param=param)
                    pcm[total : total + arr.size] = arr
                    total += arr.size

            for frame in container.decode(stream):
                put(resampler.resample(frame))
            put(resampler.resample(None))
    except (InvalidMedia, MediaTooLarge):
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        log.info("media_decode_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the audio could not be decoded", param=param) from None
    if total == 0:
        raise InvalidMedia(f"{param}: the audio decodes to no samples", param=param)
    return pcm[:total], rate


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


def normalise_audio(
    data: bytes,
    cfg: AudioConfig,
    target_rate: int | None,
    param: str,
    declared: str | None = None,
    max_bytes: int | None = None,
) -> AudioResult:
    """Probe, check and (only when needed) decode and re-encode one audio part.

    ``declared`` is the media type the client gave the part; a type naming another format is refused.
    ``max_bytes`` bounds the decoded PCM (the bytes the request may still hold).
    """
    info = probe_audio(data, param)
    check_declared("audio", declared, info.container, param)
    if info.sample_rate > cfg.max_sample_rate:
        raise InvalidMedia(
            f"{param}: the audio declares {info.sample_rate:,} Hz; the limit is {cfg.max_sample_rate:,} Hz",
            param=param,
        )
    if target_rate is None and info.sample_rate > cfg.max_output_rate:
        target_rate = cfg.max_output_rate
    if info.duration_s > cfg.max_duration_s:
        raise InvalidMedia(
            f"{param}: the audio lasts {info.duration_s:.0f} s; the limit is {cfg.max_duration_s:.0f} s",
            param=param,
        )
    if info.declared_s is not None and info.declared_s > cfg.max_duration_s:
        # A header cut short is repaired, but one claiming more than the limit is not a truncated recording.
        raise InvalidMedia(
            f"{param}: the WAV header declares {info.declared_s:,.0f} s of audio (the file holds "
            f"{info.duration_s:.1f} s); the limit is {cfg.max_duration_s:.0f} s",
            param=param,
        )
    resample = target_rate is not None and info.sample_rate != target_rate
    split = info.duration_s > cfg.segment_s
    passable = info.container in _PASS_MIME
    if not (resample or split or info.header_lies or not passable):
        return AudioResult(
            info, data, _PASS_MIME[info.container], info.container, info.sample_rate, [(0.0, info.duration_s)]
        )
    pcm, rate = decode_pcm(
        data,
        target_rate or info.sample_rate,
        param,
        min(cfg.max_duration_s, info.duration_s + 1.0),
        max_bytes,
    )
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
