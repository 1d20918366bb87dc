"""What the grounding guard compares: the premise a request carries and the claims an answer makes.

The premise is the text of the request's ``system``, ``developer``, ``user`` and
``tool`` messages (text parts only; ``tool`` messages are where retrieved
documents arrive), plus transcripts of input audio that a pre-policy put in
:attr:`core.context.RequestContext.input_transcripts`. Earlier ``assistant``
turns are not evidence: they may be the very thing that went wrong.

An answer is split into sentences with sentencex (rule-based, abbreviation
aware, and fast enough for the stream's hot path); a sentence is a *claim* when it
has at least three content words (not English stop words) or names a number, a
date or a proper name. "I hope this helps." is not a claim; "It opened in 1889."
is. The fallback scorer's fact checks (numbers, dates, names) live here too.

sentencex, dateparser and the stop words come with the ``guards`` extra, like the
scorers that judge the claims: they are imported on first use, so this module (and
the grounding plugin that imports it) loads without the extra, and the registry can
refuse the policy with a message naming it (:mod:`policies.registry`).
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from core.schemas import ChatCompletionRequest

PREMISE_ROLES = frozenset({"system", "developer", "user", "tool"})

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*")
# A number as written: optional sign, digits with thousands separators, decimals, a percent sign.
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?%?")
# Proper names: capitalised words (and runs of them, "New York"), inner capitals allowed ("McDonald").
_CAPITALISED = re.compile(r"\b[A-Z][a-zA-Z'\-]*(?:\s+[A-Z][a-zA-Z'\-]*)*")


@dataclass(frozen=True, slots=True)
class Premise:
    """The evidence an answer is judged against, and its pieces for the scorers."""

    text: str
    sentences: tuple[str, ...]

    def chunks(self, max_chars: int) -> list[str]:
        """Sentence-aligned windows of at most ``max_chars`` (a longer single sentence is its own chunk)."""
        out: list[str] = []
        cur = ""
        for s in self.sentences:
            if cur and len(cur) + len(s) > max_chars:
                out.append(cur.strip())
                cur = ""
            cur += s
        if cur.strip():
            out.append(cur.strip())
        return out


def split_sentences(text: str) -> list[str]:
    """Sentences with their trailing whitespace kept, so ``"".join(result) == text``."""
    if not text:
        return []
    from sentencex import segment  # the guards extra (module docstring)

    return list(segment("en", text))


def premise_of(
    request: ChatCompletionRequest, transcripts: Iterable[str] = (), exclude: Iterable[str] = ()
) -> Premise:
    """The premise of ``request``; texts in ``exclude`` (the guard's own retry instruction) are left out."""
    skip = {e.strip() for e in exclude if e}
    parts: list[str] = []
    for m in request.messages:
        if m.role not in PREMISE_ROLES:
            continue
        t = m.text().strip()
        if t and t not in skip:
            parts.append(t)
    parts.extend(t.strip() for t in transcripts if t and t.strip())
    text = "\n".join(parts)
    sentences: list[str] = []
    for p in parts:
        # Split each message on its own so a sentence never spans two messages.
        sentences.extend(s if s.endswith((" ", "\n")) else s + " " for s in split_sentences(p))
    return Premise(text=text, sentences=tuple(sentences))


@lru_cache(maxsize=1)
def _stop_words() -> frozenset[str]:
    """English stop words: sentence-transformers' list, from the library the grounding scorers load.

    It holds scikit-learn's 318 words and NLTK's pieces of contractions ("didn", "ll", "ve"), "did",
    "does", "doing", "having", "just", "theirs" and punctuation (which no word here contains).
    """
    from sentence_transformers.sentence_transformer.modules.tokenizer import ENGLISH_STOP_WORDS

    return frozenset(ENGLISH_STOP_WORDS)


def _content_words(sentence: str) -> list[str]:
    stop = _stop_words()
    return [w for w in _WORD.findall(sentence.lower()) if w not in stop and len(w) > 1]


def is_claim(sentence: str) -> bool:
    s = sentence.strip()
    if not s:
        return False
    return len(_content_words(s)) >= 3 or bool(numbers_in(s)) or bool(names_in(s))


def claims_of(sentences: Iterable[str]) -> list[str]:
    return [s.strip() for s in sentences if is_claim(s)]


# --- fact extraction for the fallback scorer ---------------------------------------------------------


def _norm_number(raw: str) -> str:
    pct = raw.endswith("%")
    s = raw.rstrip("%").replace(",", "").lstrip("+")
    try:
        value = float(s)
    except ValueError:
        return raw
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text + ("%" if pct else "")


def numbers_in(text: str) -> set[str]:
    """Numbers written with digits, normalised ("1,000" == "1000", "3.50" == "3.5")."""
    return {_norm_number(m.group(0).rstrip(",")) for m in _NUMBER.finditer(text)}


def names_in(text: str) -> set[str]:
    """Capitalised words that are not sentence-initial (or are part of a multi-word name), lowercased.

    A heuristic, documented as such: without a named-entity model shipped in a
    package, capitalisation inside a sentence is the signal used.
    """
    found: set[str] = set()
    stop = _stop_words()
    for sent in split_sentences(text) or [text]:
        stripped = sent.lstrip(" \t\n\"'(“‘")
        offset = len(sent) - len(stripped)
        for m in _CAPITALISED.finditer(sent):
            words = m.group(0).split()
            if m.start() == offset:
                # Sentence-initial: "The", "It", "Completed" are not names; "New York is" keeps "York".
                words = words[1:]
            for w in words:
                w = w.strip("'-").lower()
                if w.endswith("'s"):
                    w = w[:-2]
                if w and w not in stop:
                    found.add(w)
    return found


def words_in(text: str) -> set[str]:
    out = set()
    for w in _WORD.findall(text.lower()):
        w = w.strip("'-")
        out.add(w[:-2] if w.endswith("'s") else w)
    return out


DateKey = tuple[int | None, int | None, int | None]

_BASES = (
    {"RELATIVE_BASE": _dt.datetime(2000, 1, 1), "PREFER_DAY_OF_MONTH": "first", "PREFER_DATES_FROM": "past"},
    {
        "RELATIVE_BASE": _dt.datetime(2011, 7, 20),
        "PREFER_DAY_OF_MONTH": "last",
        "PREFER_DATES_FROM": "future",
    },
)


@lru_cache(maxsize=2)
def _date_parsers() -> tuple[object, object]:
    from dateparser.date import DateDataParser

    past, future = _BASES
    return DateDataParser(languages=["en"], settings=past), DateDataParser(languages=["en"], settings=future)


def dates_in(text: str) -> set[DateKey]:
    """Dates written with at least one digit, as (year, month, day) with the parts the text leaves out as None.

    dateparser finds and parses them; which parts a date really states is found by
    parsing it against two different reference dates and keeping what agrees.
    """
    from dateparser.search import search_dates

    # Only sentences with a digit can hold a date this check counts; the rest need no parsing.
    text = " ".join(s.strip() for s in split_sentences(text) if any(c.isdigit() for c in s))
    if not text:
        return set()
    found = search_dates(text, languages=["en"], settings={"RELATIVE_BASE": _BASES[0]["RELATIVE_BASE"]}) or []
    keys: set[DateKey] = set()
    a, b = _date_parsers()
    for span, _ in found:
        if not any(c.isdigit() for c in span):
            continue
        da, db = a.get_date_data(span).date_obj, b.get_date_data(span).date_obj  # type: ignore[attr-defined]
        if da is None or db is None:
            continue
        pairs = ((da.year, db.year), (da.month, db.month), (da.day, db.day))
        keys.add(tuple(x if x == y else None for x, y in pairs))  # type: ignore[arg-type]
    return {k for k in keys if any(p is not None for p in k)}


def date_supported(claim: DateKey, premise: set[DateKey]) -> bool:
    """Every part the claim states is stated, equal, by one premise date."""
    return any(all(c is None or c == q for c, q in zip(claim, p, strict=True)) for p in premise)
