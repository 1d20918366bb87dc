"""WAV framing: engines' WAV pieces become PCM, clients' WAV is rebuilt correctly."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf

from core.audio import encode, split_wav, wav_header
from core.errors import EngineProtocolError


def _tone(n: int = 2400) -> bytes:
    return (np.sin(np.arange(n) / 8) * 8000).astype("<i2").tobytes()


def test_split_wav_skips_extra_chunks():
    pcm = _tone()
    head = wav_header(24000, 1, len(pcm))
    # Insert a LIST chunk between fmt and data, as many encoders do.
    listing = b"LIST" + struct.pack("<I", 4) + b"INFO"
    blob = head[:36] + listing + head[36:] + pcm
    out, rate, channels = split_wav(blob)
    assert (out, rate, channels) == (pcm, 24000, 1)


def test_split_wav_decodes_float_wav_through_libsndfile():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(100, dtype="float32"), 16000, format="WAV", subtype="FLOAT")
    pcm, rate, _ = split_wav(buf.getvalue())
    assert rate == 16000 and len(pcm) == 200


def test_not_wav_is_a_protocol_error():
    with pytest.raises(EngineProtocolError):
        split_wav(b"ID3\x03not a wav file at all")


def test_streaming_header_reads_back_with_libsndfile():
    pcm = _tone()
    data, rate = sf.read(io.BytesIO(wav_header(24000) + pcm), dtype="int16")
    assert rate == 24000 and len(data) == 2400


@pytest.mark.parametrize("rate", [22050, 32000, 44100])
@pytest.mark.parametrize("channels", [1, 2])
def test_opus_from_a_rate_opus_does_not_code_is_resampled_to_48k(rate, channels):
    """Opus codes at 8, 12, 16, 24 and 48 kHz only: a talker at 22.05, 32 or 44.1 kHz asked for opus is
    resampled to 48 kHz, its length kept, rather than failing the answer."""
    mono = np.frombuffer(_tone(rate), dtype="<i2")
    pcm = np.repeat(mono, channels).tobytes()
    out = encode(pcm, rate, channels, "opus")
    data, got = sf.read(io.BytesIO(out), dtype="int16", always_2d=True)
    assert got == 48000 and data.shape[1] == channels
    assert abs(len(data) / 48000 - len(mono) / rate) < 0.03


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_encode_formats_round_trip(fmt):
    out = encode(_tone(24000), 24000, 1, fmt)
    data, rate = sf.read(io.BytesIO(out), dtype="int16")
    assert rate in (24000, 48000)
    assert len(data) > 0
