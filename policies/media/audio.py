"""Audio probing and normalisation: libsndfile for headers, PyAV for everything it cannot read.

The duration comes from the container's header (WAV, FLAC, OGG/Vorbis/Opus and
MP3 through libsndfile; AAC/M4A and the rest through PyAV's demuxer), never
from decoding the stream. Headers are not trusted: a WAV's data size is checked
against the bytes that are really there (and its claim against the duration
limit), a FLAC must read to the sample count its header declares, an M4A's
sample tables must fit the file. Audio that must change (resampled for
the engine, re-framed, cut into segments) is decoded once to 16-bit mono PCM
and written out as FLAC (lossless, half the bytes of WAV) or WAV, a decoded
frame at a time: what decoding holds follows what is sent, never the rate or
the length the source declares.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Iterator
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
    #: every segment as sent (``data`` is the first), kept only when the part is segmented
    segments: list[bytes] | None = None
    actions: list[str] = field(default_factory=list)

    def segment(self, i: int, encoding: str) -> bytes:
        """Segment ``i`` as sent: encoded while the part decoded, in ``fmt`` (the configured ``encoding``)."""
        assert self.segments is not None
        return self.segments[i]

    @property
    def held_bytes(self) -> int:
        """The bytes the segments after the first hold (the first is ``data``)."""
        return sum(len(s) for s in self.segments[1:]) if self.segments is not None else 0


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


def _pcm_frames(
    data: bytes, rate: int, param: str, max_s: float, max_bytes: int | None = None
) -> Iterator[np.ndarray]:
    """The stream as 16-bit mono PCM at ``rate``, one resampled frame at a time.

    Nothing is sized from the source: it stops with a 400 once the stream runs past ``max_s`` (plus a
    second of slack for the resampler), or with a 413 past ``max_bytes`` of PCM, whichever comes first.
    """
    cap = int(max_s * rate) + rate
    if max_bytes is not None and max_bytes // 2 < cap:
        cap = max_bytes // 2
    total = 0

    def checked(out: av.AudioFrame) -> np.ndarray:
        nonlocal total
        arr = out.to_ndarray().reshape(-1)
        total += arr.size
        if total > cap:
            if max_bytes is not None and cap == max_bytes // 2:
                raise MediaTooLarge(
                    f"{param}: the decoded audio exceeds the {max_bytes:,} bytes the request may still hold",
                    param=param,
                )
            raise InvalidMedia(f"{param}: the audio is longer than its header says", param=param)
        return arr

    try:
        with open_av(data, "audio", param) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    yield checked(out)
            for out in resampler.resample(None):
                yield checked(out)
    except (InvalidMedia, MediaTooLarge):
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        log.info("media_decode_failed", param=param, error=type(exc).__name__)
        raise InvalidMedia(f"{param}: the audio could not be decoded", param=param) from None
    if total == 0:
        raise InvalidMedia(f"{param}: the audio decodes to no samples", param=param)


def decode_pcm(
    data: bytes, rate: int, param: str, max_s: float, max_bytes: int | None = None
) -> tuple[np.ndarray, int]:
    """The whole stream as 16-bit mono PCM, resampled to ``rate`` frame by frame as it decodes.

    The source-rate samples are never held whole, and nothing is allocated from the declared length:
    the resampled frames are gathered as they come (see :func:`_pcm_frames` for the bounds).
    """
    pieces = list(_pcm_frames(data, rate, param, max_s, max_bytes))
    return np.concatenate(pieces), rate


class _SegmentWriter:
    """Encodes PCM pieces into segments of ``segment_s`` as they arrive; only the encoded bytes are held."""

    def __init__(self, rate: int, encoding: str, segment_s: float, max_bytes: int | None, param: str) -> None:
        self.rate, self.encoding, self.segment_s = rate, encoding, segment_s
        self.max_bytes, self.param = max_bytes, param
        self.segments: list[bytes] = []
        self.samples = 0  # written in all segments so far
        self._done_bytes = 0
        self._buf: io.BytesIO | None = None
        self._flac: sf.SoundFile | None = None
        self._end = 0  # the sample index where the open segment ends

    def write(self, arr: np.ndarray) -> None:
        while arr.size:
            if self._buf is None:
                self._open()
            take = min(arr.size, self._end - self.samples)
            piece, arr = arr[:take], arr[take:]
            if self._flac is not None:
                self._flac.write(piece)
            elif self._buf is not None:
                self._buf.write(piece.astype("<i2", copy=False).tobytes())
            self.samples += take
            assert self._buf is not None
            if self.max_bytes is not None and self._done_bytes + self._buf.tell() > self.max_bytes:
                raise MediaTooLarge(
                    f"{self.param}: the decoded audio exceeds the {self.max_bytes:,} bytes the request may "
                    "still hold",
                    param=self.param,
                )
            if self.samples >= self._end:
                self._close()

    def finish(self) -> list[bytes]:
        if self._buf is not None:
            self._close()
        return self.segments

    def _open(self) -> None:
        self._buf = io.BytesIO()
        self._end = round((len(self.segments) + 1) * self.segment_s * self.rate)
        if self.encoding == "flac":
            self._flac = sf.SoundFile(self._buf, "w", self.rate, 1, format="FLAC", subtype="PCM_16")

    def _close(self) -> None:
        assert self._buf is not None
        if self._flac is not None:
            self._flac.close()
            self._flac = None
            out = self._buf.getvalue()
        else:
            raw = self._buf.getvalue()
            out = wav_header(self.rate, 1, len(raw)) + raw
        self._buf = None
        self._done_bytes += len(out)
        self.segments.append(out)


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
    # What an OpenAI-shaped engine takes as input_audio.format (wav, mp3) or what it was configured to take.
    passable = info.container in _PASS_MIME and info.container in ("wav", "mp3", cfg.encoding)
    if not (resample or split or info.header_lies or not passable):
        return AudioResult(
            info, data, _PASS_MIME[info.container], info.container, info.sample_rate, [(0.0, info.duration_s)]
        )
    rate = target_rate or info.sample_rate
    # Decoded, resampled and encoded a frame at a time, cut into segments as the samples come: only the
    # encoded output is held, and the decode stops at the limit whatever the header declared.
    writer = _SegmentWriter(rate, cfg.encoding, cfg.segment_s, max_bytes, param)
    for arr in _pcm_frames(data, rate, param, min(cfg.max_duration_s, info.duration_s + 1.0)):
        writer.write(arr)
    segments = writer.finish()
    duration = writer.samples / rate
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
    if len(bounds) != len(segments):
        # the last segment's few samples past a boundary (rounding): one segment, as the bounds say
        bounds = [(i * cfg.segment_s, min(duration, (i + 1) * cfg.segment_s)) for i in range(len(segments))]
    if len(bounds) > 1:
        actions.append("audio-split")
    mediatype = "audio/flac" if cfg.encoding == "flac" else "audio/wav"
    return AudioResult(
        info,
        segments[0],
        mediatype,
        cfg.encoding,
        rate,
        bounds,
        segments if len(segments) > 1 else None,
        actions,
    )
