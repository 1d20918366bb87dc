"""Facts a claim states and whether they conflict with the evidence's: the check both scorers share.

A claim's facts are its numbers, dates, weekdays and proper names (:mod:`policies.grounding.claims`).
A fact the evidence does not state is not, by itself, a reason to fail a claim: "Paris is the capital
of France." states a name no document about a meeting mentions, and it is merely *unverifiable* there.
It is a **conflict** when the claim is about the same thing as an evidence sentence (they share their
subject: :func:`about`) and that sentence states a value of the same kind the claim does not: the
document says the meeting is on Tuesday, the answer says Friday; revenue 12 million, the answer 15.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from policies.grounding.claims import (
    DateKey,
    date_supported,
    dates_in,
    measures_in,
    names_in,
    numbers_in,
    tokens_in,
    weekdays_in,
    without_weekdays,
    words_in,
)


@dataclass(frozen=True, slots=True)
class Facts:
    numbers: frozenset[str]
    dates: frozenset[DateKey]
    weekdays: frozenset[int]
    names: frozenset[str]


@lru_cache(maxsize=4096)
def facts_of(text: str) -> Facts:
    """The facts ``text`` states (cached: a document's sentences are judged against again and again)."""
    return Facts(
        frozenset(numbers_in(text)),
        frozenset(dates_in(text)),
        frozenset(weekdays_in(text)),
        frozenset(names_in(text)),
    )


@dataclass(frozen=True, slots=True)
class Missing:
    """A claim's facts the evidence does not state, by kind, with what to say about the first of them."""

    kinds: frozenset[str]
    reason: str | None


def missing(claim: Facts, evidence: Facts, evidence_words: set[str]) -> Missing:
    """Which kinds of the claim's facts are not in the evidence (``numeric``: numbers and dates)."""
    kinds: set[str] = set()
    reasons: list[str] = []
    for n in sorted(claim.numbers - evidence.numbers):
        kinds.add("numeric")
        reasons.append(f"number {n}")
    for d in sorted(claim.dates, key=str):
        if not date_supported(d, set(evidence.dates)):
            kinds.add("numeric")
            reasons.append("date " + "-".join("?" if p is None else str(p) for p in d))
    for w in sorted(claim.weekdays - evidence.weekdays):
        kinds.add("weekday")
        reasons.append(f"weekday {_WEEKDAY_NAMES_BY_DAY[w]}")
    for name in sorted(claim.names):
        # A weekday is counted as a weekday, not as a name as well.
        if name not in evidence_words and name not in _WEEKDAY_NAMES:
            kinds.add("name")
            reasons.append(f"name {name!r}")
    return Missing(frozenset(kinds), reasons[0] + " is not in the evidence" if reasons else None)


_WEEKDAY_NAMES = frozenset({"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"})


def _states_other(sentence: Facts, claim: Facts, kind: str) -> list[str]:
    """The values of ``kind`` an evidence sentence states that the claim does not."""
    if kind == "numeric":
        nums = sorted(sentence.numbers - claim.numbers)
        dates = [d for d in sentence.dates if not date_supported(d, set(claim.dates))]
        return nums + ["-".join("?" if p is None else str(p) for p in d) for d in dates]
    if kind == "weekday":
        return [_WEEKDAY_NAMES_BY_DAY[d] for d in sorted(sentence.weekdays - claim.weekdays)]
    return sorted(n for n in sentence.names - claim.names if n not in _WEEKDAY_NAMES)


_WEEKDAY_NAMES_BY_DAY = {
    1: "Monday",
    2: "Tuesday",
    3: "Wednesday",
    4: "Thursday",
    5: "Friday",
    6: "Saturday",
    7: "Sunday",
}


def conflict(
    claim: str,
    evidence: Sequence[str],
    about: Callable[[str, str], float],
    floor: float,
    evidence_facts: Facts | None = None,
) -> str | None:
    """Why ``claim`` conflicts with the evidence, or None when it does not.

    ``about(claim, sentence)`` says on 0..1 how much the two share their subject; a sentence at or
    above ``floor`` is about the claim's subject. The claim conflicts when it states a fact the evidence
    does not and a sentence about its subject states a different value of that kind.
    """
    cf = facts_of(claim)
    if not (cf.numbers or cf.dates or cf.weekdays or cf.names):
        return None
    ef = evidence_facts or facts_of(" ".join(evidence))
    gone = missing(cf, ef, words_in(" ".join(evidence)))
    if not gone.kinds:
        return None
    best: tuple[float, str] | None = None
    units = {u: n for n, u in measures_in(claim).items() if u and n not in ef.numbers}
    for sentence in evidence:
        sf = facts_of(sentence.strip())
        share: float | None = None
        for kind in sorted(gone.kinds):
            others = _states_other(sf, cf, kind)
            if not others:
                continue
            share = about(claim, sentence) if share is None else share
            if share >= floor and (best is None or share > best[0]):
                said = ", ".join(others[:3])
                best = (share, f"{gone.reason}: the evidence says {said} about the same subject")
        # A number of the same measure ("31 degrees" against "18 degrees") in a sentence that shares a
        # name with the claim ("Paris") or its subject: the claim may go on about other things as well.
        same = [(u, n) for n, u in measures_in(sentence).items() if u in units and n not in cf.numbers]
        if same and best is None:
            share = about(claim, sentence) if share is None else share
            if cf.names & words_in(sentence) or share >= floor:
                unit, stated = same[0]
                best = (share, f"number {units[unit]} {unit} is not in the evidence: it says {stated} {unit}")
    return best[1] if best is not None else None


def lexical_about(claim: str, sentence: str) -> float:
    """How much of the claim's wording (its facts left out) the sentence shares: the share of the claim's
    tokens (:func:`policies.grounding.claims.tokens_in`) found in the sentence. Any script."""
    c = _subject_tokens(claim)
    if not c:
        return 0.0
    return len(c & _subject_tokens(sentence)) / len(c)


@lru_cache(maxsize=4096)
def _subject_tokens(text: str) -> frozenset[str]:
    # The facts are what may differ; the subject is the rest ("会议在星期五举行" → 会议, 议在, 举行).
    f = facts_of(text)
    return frozenset(tokens_in(without_weekdays(text)) - set(f.names) - _WEEKDAY_NAMES)
