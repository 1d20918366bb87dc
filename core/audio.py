"""PCM16 and WAV helpers: engines hand the gateway PCM, clients get the format they asked for."""

from __future__ import annotations

import io
import struct
from typing import Any

from core.errors import EngineProtocolError

# A streamed WAV cannot know its length up front; 0xFFFFFFFF is the convention
# streaming servers use, and libsndfile and browsers read up to the real end.
_STREAMING_SIZE = 0xFFFFFFFF

STREAMABLE_FORMATS = frozenset({"wav", "pcm16", "pcm"})
#: what :func:`encode` can produce (libsndfile has no AAC encoder)
ENCODABLE_FORMATS = frozenset({"wav", "pcm16", "pcm", "flac", "mp3", "opus"})
#: the rates Opus codes at, and the one other rates are resampled to for it
OPUS_RATES = frozenset({8000, 12000, 16000, 24000, 48000})
OPUS_RATE = 48000


def wav_header(sample_rate: int, channels: int = 1, data_bytes: int | None = None) -> bytes:
    block = channels * 2
    if data_bytes is None:
        riff_size = data_size = _STREAMING_SIZE
    else:
        data_size = data_bytes
        riff_size = 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


def split_wav(blob: bytes) -> tuple[bytes, int, int]:
    """Return (pcm16 bytes, sample rate, channels) of a PCM16 WAV blob.

    Walks the RIFF chunks rather than assuming a 44-byte header, since encoders
    add LIST/fact chunks. Non-PCM16 WAV is decoded through libsndfile.
    """
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise EngineProtocolError("engine sent audio that is not WAV")
    pos = 12
    rate = channels = bits = fmt_tag = 0
    while pos + 8 <= len(blob):
        cid = blob[pos : pos + 4]
        (size,) = struct.unpack_from("<I", blob, pos + 4)
        body = pos + 8
        if cid == b"fmt ":
            fmt_tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", blob, body)
        elif cid == b"data":
            end = len(blob) if size in (0, _STREAMING_SIZE) else min(len(blob), body + size)
            if fmt_tag == 1 and bits == 16:
                return blob[body:end], rate, channels
            return _decode_other(blob)
        pos = body + size + (size & 1)
    raise EngineProtocolError("engine sent a WAV file without a data chunk")


def _decode_other(blob: bytes) -> tuple[bytes, int, int]:
    import soundfile as sf  # numpy and libsndfile only when audio needs transcoding

    try:
        data, rate = sf.read(io.BytesIO(blob), dtype="int16", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as exc:
        raise EngineProtocolError("engine sent undecodable audio") from exc
    return data.tobytes(), rate, data.shape[1]


def _resampled(samples: Any, rate: int, to: int) -> Any:
    """``samples`` (int16, frames × channels) at ``to`` Hz, through FFmpeg's resampler (PyAV)."""
    import av
    import numpy as np

    channels = samples.shape[1]
    layout = "mono" if channels == 1 else "stereo" if channels == 2 else f"{channels}c"
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(samples.reshape(1, -1)), format="s16", layout=layout
    )
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="s16", layout=layout, rate=to)
    pieces = [f.to_ndarray() for f in (*resampler.resample(frame), *resampler.resample(None))]
    if not pieces:
        return np.zeros((0, channels), dtype=np.int16)
    return np.concatenate(pieces, axis=1).reshape(-1, channels)


def encode(pcm: bytes, sample_rate: int, channels: int, fmt: str) -> bytes:
    """Encode a whole PCM16 buffer as the client asked (non-streaming responses)."""
    if fmt in ("pcm16", "pcm"):
        return pcm
    if fmt == "wav":
        return wav_header(sample_rate, channels, len(pcm)) + pcm
    import numpy as np
    import soundfile as sf

    samples = np.frombuffer(pcm, dtype="<i2").reshape(-1, channels)
    out = io.BytesIO()
    if fmt == "flac":
        sf.write(out, samples, sample_rate, format="FLAC")
    elif fmt == "mp3":
        sf.write(out, samples, sample_rate, format="MP3")
    elif fmt == "opus":
        if sample_rate not in OPUS_RATES:  # Opus codes at its own rates only (libsndfile refuses others)
            samples, sample_rate = _resampled(samples, sample_rate, OPUS_RATE), OPUS_RATE
        sf.write(out, samples, sample_rate, format="OGG", subtype="OPUS")
    else:  # aac has no encoder in libsndfile; gateway.speech refuses it before any engine work
        raise ValueError(f"cannot encode audio as {fmt}")
    return out.getvalue()
