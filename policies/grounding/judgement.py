"""What a grounding scorer returns: a three-way label and a score per claim, and the answer's judgement.

A claim the request's evidence entails is ``supported``; one it contradicts (or one that states a
number, date or name about the evidence's own subject with a different value) is ``contradicted``; one
the evidence neither supports nor contradicts is ``unverifiable``: not failed, only not checkable here.
The answer's score is the minimum over the claims that were checked (supported or contradicted);
unverifiable claims are reported, never counted, so an answer with nothing to check scores 1.0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ClaimLabel = Literal["supported", "contradicted", "unverifiable"]
LABELS: tuple[ClaimLabel, ...] = ("supported", "contradicted", "unverifiable")


@dataclass(frozen=True, slots=True)
class ClaimScore:
    """One claim's judgement: ``score`` on 0..1 (the threshold's scale) and its ``label``.

    A scorer that gives no label (``None``) leaves the score alone to decide: the claim is counted,
    as every claim was before labels existed.
    """

    claim: str
    score: float
    reason: str | None = None
    label: ClaimLabel | None = None

    @property
    def checked(self) -> bool:
        """Whether the claim counts towards the answer's score (everything but ``unverifiable``)."""
        return self.label != "unverifiable"


@dataclass(frozen=True, slots=True)
class Judgement:
    """A scored answer (or part of one): the minimum over its checked claims, and each claim's judgement."""

    score: float
    claims: tuple[ClaimScore, ...]

    @classmethod
    def of(cls, claims: Sequence[ClaimScore]) -> Judgement:
        return cls(min((c.score for c in claims if c.checked), default=1.0), tuple(claims))

    @property
    def weakest(self) -> ClaimScore | None:
        """The lowest-scoring checked claim (the one that decides the score), if any was checked."""
        checked = [c for c in self.claims if c.checked]
        return min(checked, key=lambda c: c.score) if checked else None

    @property
    def checked(self) -> int:
        return sum(1 for c in self.claims if c.checked)

    def counts(self) -> dict[str, int]:
        """Claims per label (``scored`` for claims without one), for receipts and notes."""
        n: Counter[str] = Counter(c.label or "scored" for c in self.claims)
        return {k: n[k] for k in (*LABELS, "scored") if n[k] or k in LABELS}

    def merge(self, other: Judgement) -> Judgement:
        return Judgement.of(self.claims + other.claims)


def nli_claim(
    claim: str,
    entailment: float,
    contradiction: float | None,
    *,
    conflict: str | None = None,
) -> ClaimScore:
    """One claim's judgement from NLI probabilities of its best premise chunks.

    ``entailment`` is the highest P(entailment) over the premise's chunks, ``contradiction`` the
    highest P(contradiction) (``None`` for a model without that label). The larger of the two wins when
    it is over one half; neither: the claim is unverifiable, unless ``conflict`` (a fact check's finding,
    :func:`policies.grounding.facts.conflict`) says it gives a value of the evidence's own subject that
    differs from the evidence: that is a contradiction too. Shared by every NLI backend.
    """
    contra = contradiction if contradiction is not None else 0.0
    if entailment >= 0.5 and entailment >= contra:
        return ClaimScore(claim, _clip(entailment), "entailment", "supported")
    if contra >= 0.5:
        return ClaimScore(claim, _clip(min(entailment, 1.0 - contra)), "contradiction", "contradicted")
    if conflict is not None:
        return ClaimScore(claim, _clip(min(entailment, 1.0 - contra)), conflict, "contradicted")
    return ClaimScore(claim, _clip(entailment), "neither entailed nor contradicted", "unverifiable")


def _clip(x: float) -> float:
    if x != x:  # NaN
        return 0.0
    return min(1.0, max(0.0, x))
