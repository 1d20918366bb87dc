"""PCM16 for a realtime session: the WAV a committed turn is sent to the engine as, and the resampling of an
answer's audio to the session's rate (vLLM-Omni's talkers speak at 16, 24, 44.1 or 48 kHz)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from core.audio import wav_header


def wav_b64(pcm: bytes, rate: int) -> str:
    """A committed turn as the base64 WAV an ``input_audio`` part carries."""
    return base64.b64encode(wav_header(rate, 1, len(pcm)) + pcm).decode("ascii")


def seconds(pcm_bytes: int, rate: int, channels: int = 1) -> float:
    return pcm_bytes / (2 * channels * rate) if rate else 0.0


def digest(pcm: bytes) -> str:
    return hashlib.sha256(pcm).hexdigest()


def resampled(pcm: bytes, rate: int, out_rate: int) -> bytes:
    """Mono PCM16 at ``rate`` as a whole at ``out_rate`` (a committed turn at the engine's rate)."""
    resample = Resampler(out_rate)
    return resample(pcm, rate) + resample.flush()


class Resampler:
    """An answer's PCM16 at the engine's rate (and channels) to mono at the session's, piece by piece.

    FFmpeg's resampler (PyAV's ``AudioResampler``) keeps its filter state between pieces, so consecutive
    pieces join without a seam; :meth:`flush` gives what its filter still holds at the answer's end. One
    resampler per answer (its state is that answer's); PyAV and numpy load with the first answer that
    needs them."""

    def __init__(self, out_rate: int) -> None:
        self.out_rate = out_rate
        self._resampler: Any = None
        self._input: tuple[int, int] | None = None  # the (rate, channels) the resampler was made for

    def __call__(self, pcm: bytes, rate: int, channels: int = 1) -> bytes:
        pcm = pcm[: len(pcm) - len(pcm) % (2 * channels)]
        if not pcm or not rate:
            return b""
        if rate == self.out_rate and channels == 1 and self._resampler is None:
            return pcm
        import av
        import numpy as np

        layout = _LAYOUTS.get(channels, f"{channels}c")
        if self._input != (rate, channels):
            out = self.flush()  # a change of rate mid-answer: what the old filter held first
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=self.out_rate)
            self._input = (rate, channels)
        else:
            out = b""
        frame = av.AudioFrame.from_ndarray(
            np.frombuffer(pcm, dtype="<i2").reshape(1, -1), format="s16", layout=layout
        )
        frame.sample_rate = rate
        return out + b"".join(f.to_ndarray().tobytes() for f in self._resampler.resample(frame))

    def flush(self) -> bytes:
        """What the resampler still holds of the answer (at its end)."""
        if self._resampler is None:
            return b""
        resampler, self._resampler, self._input = self._resampler, None, None
        return b"".join(f.to_ndarray().tobytes() for f in resampler.resample(None))


_LAYOUTS = {1: "mono", 2: "stereo"}
