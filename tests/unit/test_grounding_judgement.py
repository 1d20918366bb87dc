"""The three-way judgement of claims: what counts towards an answer's score, and the NLI rule every backend shares."""

from __future__ import annotations

import pytest

from policies.grounding.judgement import ClaimScore, Judgement, nli_claim


def test_unverifiable_claims_are_reported_but_not_counted():
    j = Judgement.of(
        [
            ClaimScore("a", 0.9, label="supported"),
            ClaimScore("b", 0.1, label="unverifiable"),
        ]
    )
    assert j.score == 0.9 and j.checked == 1
    assert j.weakest is not None and j.weakest.claim == "a"
    assert j.counts() == {"supported": 1, "contradicted": 0, "unverifiable": 1}


def test_nothing_checked_scores_one_and_has_no_weakest_claim():
    j = Judgement.of([ClaimScore("b", 0.0, label="unverifiable")])
    assert j.score == 1.0 and j.checked == 0 and j.weakest is None
    assert Judgement.of(()).score == 1.0


def test_a_claim_without_a_label_counts_by_its_score_as_before():
    # A scorer written before labels existed: ClaimScore(claim, score, reason).
    j = Judgement.of([ClaimScore("a", 0.95, "entailment"), ClaimScore("b", 0.2, "entailment")])
    assert j.score == 0.2 and j.checked == 2
    assert j.counts()["scored"] == 2


def test_merge_keeps_every_claim_and_recounts():
    a = Judgement.of([ClaimScore("a", 0.9, label="supported")])
    b = Judgement.of([ClaimScore("b", 0.0, label="contradicted"), ClaimScore("c", 0.3, label="unverifiable")])
    m = a.merge(b)
    assert m.score == 0.0 and len(m.claims) == 3 and m.checked == 2


@pytest.mark.parametrize(
    ("entail", "contra", "conflict", "label"),
    [
        (0.9, 0.05, None, "supported"),
        (0.05, 0.9, None, "contradicted"),
        (0.2, 0.3, None, "unverifiable"),  # neutral: neither over one half
        (0.2, 0.3, "number 15 is not in the evidence", "contradicted"),  # neutral, but a fact conflicts
        (0.3, None, None, "unverifiable"),  # a model without a contradiction label
        (0.9, None, "ignored when entailed", "supported"),
    ],
)
def test_nli_labels(entail, contra, conflict, label):
    c = nli_claim("x", entail, contra, conflict=conflict)
    assert c.label == label
    if label == "contradicted":
        assert c.score < 0.8
    if label == "supported":
        assert c.score == entail
