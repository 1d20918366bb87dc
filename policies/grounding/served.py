"""The grounding scorer served by an engine: an NLI model behind vLLM's ``/score`` or ``/classify``.

``grounding.scorer: served`` builds it (gateway/services.py). Like the in-process cross-encoder it
scores each claim against each premise chunk and keeps the best chunk, then the answer's weakest
claim; the pairs of concurrent requests go to the engine in shared calls
(:class:`policies.served.client.ServedModel`). With ``endpoint: score`` (or ``rerank``, ``tei-rerank``)
the model is a one-label cross-encoder and its score is P(supported); with ``endpoint: classify`` the
model has an entailment label (and, often, a contradiction one): vLLM 0.32 classifies a text pair only
as token ids, so the pairs are tokenised here with the model's own tokenizer (``grounding.tokenizer``).
The engine failing, or not answering within ``served.timeout_s``, is
:class:`core.errors.GuardUnavailable`: the grounding policy's ``on_error`` decides.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

import structlog

from core.errors import GuardUnavailable
from observability.metrics import Metrics
from policies.grounding.claims import Premise
from policies.grounding.facts import conflict, lexical_about
from policies.grounding.judgement import ClaimScore, Judgement, nli_claim
from policies.grounding.scorer import ScorerLoadError
from policies.served.client import ServedModel
from policies.settings import GroundingSettings, ServedModelSettings

log = structlog.get_logger(__name__)


class ServedScorer:
    """Implements :class:`policies.grounding.scorer.Scorer` with a model an engine serves."""

    kind = "served"

    def __init__(self, settings: GroundingSettings, metrics: Metrics | None = None) -> None:
        if settings.served is None:
            raise ValueError("ServedScorer needs grounding.served")
        self.settings = settings
        self.served: ServedModelSettings = settings.served
        self._metrics = metrics
        self._client: ServedModel | None = None
        self._tokenizer: Any = None
        self._entail: str | None = None  # classify: the label names read from the answer
        self._contra: str | None = None
        self.loaded = False

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, **ServedModel.describe_settings(self.served)}
        if self.served.endpoint == "classify":
            out["entailment_label"] = self._entail
            out["contradiction_label"] = self._contra
        out["loaded"] = self.loaded
        return out

    @property
    def client(self) -> ServedModel:
        if self._client is None:
            raise GuardUnavailable("the served grounding scorer was not started")
        return self._client

    def load(self) -> None:
        """Blocking: for ``classify``, the tokenizer and the labels (nothing of the engine is read here:
        an engine down at start-up is a guard that cannot judge, at request time, not a failed boot)."""
        if self.served.endpoint == "classify":
            self._entail, self._contra = self._columns()
            if not self.settings.tokenizer:
                raise ScorerLoadError("grounding.tokenizer: endpoint classify needs the model's tokenizer")
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer)
            except Exception as exc:  # any load failure is reported with the configured name
                raise ScorerLoadError(
                    f"grounding.tokenizer: cannot load {self.settings.tokenizer!r}: {exc}"
                ) from exc
        self.loaded = True
        log.info("grounding_scorer_loaded", **self.describe())

    def _columns(self) -> tuple[str, str | None]:
        labels = self.served.labels
        want = self.settings.entailment_label
        names = labels if labels is not None else []
        if isinstance(want, int):
            if labels is not None and not 0 <= want < len(labels):
                raise ScorerLoadError(
                    f"grounding.entailment_label: {want} is not one of {len(labels)} labels"
                )
            entail = labels[want] if labels is not None else str(want)
        elif isinstance(want, str):
            if labels is not None and want not in labels:
                raise ScorerLoadError(f"grounding.entailment_label: {want!r} is not one of {labels}")
            entail = want
        else:
            hits = [n for n in names if "entail" in n.lower() and "not" not in n.lower()]
            if len(hits) != 1:
                raise ScorerLoadError(
                    "grounding.served.labels: cannot tell the entailment label from "
                    f"{labels}; set grounding.entailment_label (or served.labels)"
                )
            entail = hits[0]
        contra = next((n for n in names if "contradict" in n.lower()), None)
        return entail, contra

    async def start(self) -> None:
        if not self.loaded:
            await asyncio.to_thread(self.load)
        if self._client is None:
            self._client = ServedModel(self.served, name="grounding")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def judge(self, premise: Premise, claims: Sequence[str]) -> Judgement:
        claims = [c for c in claims if c.strip()]
        if not claims:
            return Judgement.of(())
        chunks = premise.chunks(self.settings.premise_chunk_chars) or [""]
        pairs = [(chunk, claim) for claim in claims for chunk in chunks]
        t0 = time.perf_counter()
        contra: list[float] | None
        try:
            if self.served.endpoint == "classify":
                probs = await self.client.classify([self._pair_ids(a, b) for a, b in pairs])
                entail = [_finite(p.get(self._entail or "", math.nan)) for p in probs]
                contra = [_finite(p.get(self._contra, math.nan)) for p in probs] if self._contra else None
            else:
                entail = [_finite(x) for x in await self.client.score(pairs)]
                contra = None
        except GuardUnavailable as exc:
            log.error("grounding_scorer_failed", scorer=self.kind, error=str(exc))
            raise
        finally:
            if self._metrics is not None:
                self._metrics.grounding_scorer_seconds.labels(self.kind).observe(time.perf_counter() - t0)
        n = len(chunks)
        judged: list[ClaimScore] = []
        for k, claim in enumerate(claims):
            e = max(entail[k * n : (k + 1) * n])
            c = None if contra is None else max(contra[k * n : (k + 1) * n])
            judged.append(nli_claim(claim, e, c))
        if any(j.label == "unverifiable" for j in judged):
            # Neutral to the model: still a contradiction when it gives the evidence's subject another
            # number, date or name (the same check as the in-process cross-encoder's; off the event loop).
            judged = await asyncio.to_thread(self._conflicts, premise, judged, entail, contra, n)
        return Judgement.of(judged)

    def _conflicts(
        self,
        premise: Premise,
        judged: list[ClaimScore],
        entail: list[float],
        contra: list[float] | None,
        n: int,
    ) -> list[ClaimScore]:
        evidence = [s.strip() for s in premise.sentences]
        floor = self.settings.subject_similarity
        out = []
        for k, j in enumerate(judged):
            if j.label == "unverifiable":
                why = conflict(j.claim, evidence, lexical_about, floor)
                if why is not None:
                    e = max(entail[k * n : (k + 1) * n])
                    c = None if contra is None else max(contra[k * n : (k + 1) * n])
                    j = nli_claim(j.claim, e, c, conflict=why)
            out.append(j)
        return out

    def _pair_ids(self, premise: str, claim: str) -> list[int]:
        ids = self._tokenizer(premise, claim, truncation=True, max_length=self.settings.max_length)[
            "input_ids"
        ]
        return [int(i) for i in ids]


def _finite(x: float) -> float:
    return 0.0 if math.isnan(x) else x
