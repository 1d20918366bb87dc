"""PCM16 for a realtime session: the WAV a committed turn is sent to the engine as, and the resampling of an
answer's audio to the session's rate (vLLM-Omni's talkers speak at 16, 24, 44.1 or 48 kHz)."""

from __future__ import annotations

import base64
import hashlib

import numpy as np

from core.audio import wav_header


def wav_b64(pcm: bytes, rate: int) -> str:
    """A committed turn as the base64 WAV an ``input_audio`` part carries."""
    return base64.b64encode(wav_header(rate, 1, len(pcm)) + pcm).decode("ascii")


def seconds(pcm_bytes: int, rate: int, channels: int = 1) -> float:
    return pcm_bytes / (2 * channels * rate) if rate else 0.0


def digest(pcm: bytes) -> str:
    return hashlib.sha256(pcm).hexdigest()


class Resampler:
    """An answer's PCM16 at the engine's rate (and channels) to mono at the session's, piece by piece.

    Linear interpolation over a running position, so consecutive pieces join without a seam; one resampler
    per answer (its state is that answer's)."""

    def __init__(self, out_rate: int) -> None:
        self.out_rate = out_rate
        self._pos = 0.0  # where the next output sample falls, in input samples from the held one
        self._last: np.ndarray | None = None  # the previous piece's last sample, interpolated against

    def __call__(self, pcm: bytes, rate: int, channels: int = 1) -> bytes:
        x = np.frombuffer(pcm[: len(pcm) - len(pcm) % (2 * channels)], dtype="<i2")
        if channels > 1:
            x = x.reshape(-1, channels).mean(axis=1).astype(np.int16)
        if rate == self.out_rate or not rate:
            return x.astype("<i2").tobytes()
        src = x.astype(np.float64)
        if self._last is not None:
            src = np.concatenate([self._last, src])
        if src.size < 2:
            self._last = src
            return b""
        step = rate / self.out_rate
        at = np.arange(self._pos, src.size - 1, step)
        out = np.interp(at, np.arange(src.size), src)
        self._pos = (at[-1] + step) - (src.size - 1) if at.size else self._pos - (src.size - 1)
        self._last = src[-1:]
        pcm_out: bytes = np.clip(np.rint(out), -32768, 32767).astype("<i2").tobytes()
        return pcm_out
