"""Server VAD: the Silero VAD ONNX model that faster-whisper ships, run on onnxruntime, fed a session's PCM16.

The model file is found through the import system without importing faster-whisper (which would load
ctranslate2): faster-whisper is an optional extra, and without it server VAD is refused by name. The
inference session is made once per process and shared (onnxruntime's ``run`` is thread-safe); the LSTM
state, the audio context and the speech state machine are per session (:class:`VoiceActivity`).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gateway.realtime_settings import VadParams

#: Silero runs on 16 kHz windows of 512 samples (32 ms), each with the 64 samples before it
_RATE, _WINDOW, _CONTEXT = 16000, 512, 64
_MS_PER_WINDOW = _WINDOW * 1000 // _RATE
_MODEL_NAME = "silero_vad_v6.onnx"


def model_path() -> Path | None:
    """The Silero VAD model faster-whisper ships, or None when faster-whisper is not installed."""
    spec = importlib.util.find_spec("faster_whisper")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "assets" / _MODEL_NAME
        if path.is_file():
            return path
    return None


_lock = threading.Lock()


@functools.cache
def _session(path: Path) -> Any:
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    # One thread each: many sessions share two cores; a 32 ms window takes well under a millisecond.
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"], sess_options=opts)


def shared_model() -> Any:
    """The process's inference session (made on first use); raises FileNotFoundError without the model."""
    path = model_path()
    if path is None:
        raise FileNotFoundError(f"{_MODEL_NAME} not found: install the 'guards' extra (faster-whisper)")
    with _lock:
        return _session(path)


def to_16k(pcm: bytes, rate: int) -> np.ndarray:
    """PCM16 mono at ``rate`` as float32 samples at 16 kHz in [-1, 1] (linear interpolation: enough for VAD)."""
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if rate == _RATE or x.size == 0:
        return x
    n = round(x.size * _RATE / rate)
    out: np.ndarray = np.interp(np.linspace(0, x.size - 1, n), np.arange(x.size), x).astype(np.float32)
    return out


Event = tuple[Literal["started", "stopped"], int]


class VoiceActivity:
    """One session's detector: feed it PCM16, get back speech starts and stops at ms into the session's audio."""

    def __init__(self, model: Any, params: VadParams) -> None:
        self.model, self.params = model, params
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(_CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._windows = 0  # windows run: 32 ms each, the clock of the events
        self.speaking = False
        self._silent_ms = 0

    def feed(self, pcm: bytes, rate: int) -> list[Event]:
        samples = np.concatenate([self._pending, to_16k(pcm, rate)])
        events: list[Event] = []
        usable = samples.size - samples.size % _WINDOW
        for at in range(0, usable, _WINDOW):
            window = samples[at : at + _WINDOW]
            prob = self._run(window)
            self._windows += 1
            now_ms = self._windows * _MS_PER_WINDOW
            if not self.speaking and prob >= self.params.threshold:
                self.speaking, self._silent_ms = True, 0
                events.append(("started", max(0, now_ms - _MS_PER_WINDOW - self.params.prefix_padding_ms)))
            elif self.speaking:
                # Hysteresis as Silero's own iterator: silence is a probability well under the threshold.
                if prob < self.params.threshold - 0.15:
                    self._silent_ms += _MS_PER_WINDOW
                    if self._silent_ms >= self.params.silence_duration_ms:
                        self.speaking = False
                        events.append(("stopped", now_ms - self._silent_ms))
                else:
                    self._silent_ms = 0
        self._pending = samples[usable:]
        return events

    def _run(self, window: np.ndarray) -> float:
        x = np.concatenate([self._context, window])[None, :]
        self._context = window[-_CONTEXT:]
        out, self._h, self._c = self.model.run(None, {"input": x, "h": self._h, "c": self._c})
        return float(np.asarray(out).reshape(-1)[0])
