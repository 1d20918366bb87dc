"""What the grounding guard compares: the premise a request carries and the claims an answer makes.

The premise is the text of the request's ``system``, ``developer``, ``user`` and
``tool`` messages (text parts only; ``tool`` messages are where retrieved
documents arrive), plus transcripts of input audio that a pre-policy put in
:attr:`core.context.RequestContext.input_transcripts`. Earlier ``assistant``
turns are not evidence: they may be the very thing that went wrong.

Text is split into sentences with sentencex (rule-based, abbreviation aware, and
fast enough for the stream's hot path), in the language its script says (:func:`language_of`:
Chinese, Japanese, Korean, else English rules). A sentence is a *claim* when it is not a
question and has at least three words (a CJK character counts as half a word) or names a
number, a date, a weekday or a proper name: "Sure." and "Why?" are not claims. A claim that
says nothing the evidence bears on is judged *unverifiable*, not failed, so the test only has
to keep out what states nothing at all. The premise's *evidence* is its sentences that state
something (:func:`states`): not questions, and naming a fact or at least six words; a request
whose premise has none (an open-domain question, "What is the capital of France?") has
no evidence to judge an answer against. The fact checks (numbers, dates, weekdays, names)
live here too; how they are compared is :mod:`policies.grounding.facts`.

sentencex and dateparser come with the ``guards`` extra, like the scorers that judge the
claims: they are imported on first use, so this module (and the grounding plugin that imports
it) loads without the extra, and the registry can refuse the policy with a message naming it
(:mod:`policies.registry`).
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
# Scripts written without spaces between words: Han, kana, Hangul (their characters are tokens).
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_CJK_CHAR = re.compile(f"[{_CJK}]")
# A word of a spaced script: letters of any alphabet, not CJK and not digits.
_ANY_WORD = re.compile(f"(?:(?![{_CJK}])[^\\W\\d_])+(?:['\\-](?:(?![{_CJK}])[^\\W\\d_])+)*")
_KANA = re.compile("[\u3040-\u30ff]")
_HANGUL = re.compile("[\uac00-\ud7af]")
# A number as written: optional sign, digits with thousands separators, decimals, a percent sign. Not
# glued to Latin letters ("Qwen3" is a name); CJK may touch it ("营收为1200万元").
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])[-+]?\d[\d,]*(?:\.\d+)?%?")
# What a number counts: the next word, or up to two CJK characters ("万元", "米").
_UNIT = re.compile(f"\\s*((?:(?![{_CJK}])[^\\W\\d_])+|[{_CJK}]{{1,2}})")
_QUESTION_END = re.compile(r"[?？]\W*$")
# Weekdays as facts: English names and the Chinese 星期/周/礼拜 forms, as 1 (Monday) to 7 (Sunday).
_WEEKDAYS_EN = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_WEEKDAY_EN = re.compile(r"\b(" + "|".join(_WEEKDAYS_EN) + r")\b", re.IGNORECASE)
_WEEKDAY_ZH = re.compile("(?:星期|礼拜|周)([一二三四五六日天])")
_ZH_DAY = {"一": 1, "二": 2, "三": 3, "四": 4, "五": 5, "六": 6, "日": 7, "天": 7}
# Proper names: capitalised words (and runs of them, "New York"), inner capitals allowed ("McDonald").
_CAPITALISED = re.compile(r"\b[A-Z][a-zA-Z'\-]*(?:\s+[A-Z][a-zA-Z'\-]*)*")


@dataclass(frozen=True, slots=True)
class Premise:
    """The evidence an answer is judged against, and its pieces for the scorers.

    ``text`` is all of the premise's text; ``sentences`` are its *evidence*: the sentences that state
    something (:func:`states`), which the scorers judge claims against. Questions and instructions are
    in ``text`` only.
    """

    text: str
    sentences: tuple[str, ...]

    @property
    def has_evidence(self) -> bool:
        return bool(self.sentences)

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


def language_of(text: str) -> str:
    """The language whose sentence rules fit ``text``, from its script: ja (kana), ko (Hangul), zh (Han), en.

    sentencex needs a language; telling the script is enough for where sentences end (the
    full stops of CJK, abbreviations of Latin scripts), and costs a few regex scans.
    """
    if _KANA.search(text):
        return "ja"
    if _HANGUL.search(text):
        return "ko"
    if _CJK_CHAR.search(text):
        return "zh"
    return "en"


def split_sentences(text: str, language: str | None = None) -> list[str]:
    """Sentences with their trailing whitespace kept, so ``"".join(result) == text``."""
    if not text:
        return []
    from sentencex import segment  # the guards extra (module docstring)

    return list(segment(language or language_of(text), text))


def premise_of(
    request: ChatCompletionRequest,
    transcripts: Iterable[str] = (),
    exclude: Iterable[str] = (),
    *,
    roles: Iterable[str] = PREMISE_ROLES,
    evidence: Iterable[str] = (),
) -> Premise:
    """The premise of ``request``: the text of its messages of ``roles``, then ``transcripts`` (of its input
    audio), then ``evidence``: further evidence texts a pre-policy found in the request (what its images
    or video frames show, once a policy describes them). Texts in ``exclude`` (the guard's own retry
    instruction) are left out."""
    skip = {e.strip() for e in exclude if e}
    wanted = set(roles)
    parts: list[str] = []
    for m in request.messages:
        if m.role not in wanted:
            continue
        t = m.text().strip()
        if t and t not in skip:
            parts.append(t)
    parts.extend(t.strip() for t in transcripts if t and t.strip())
    parts.extend(t.strip() for t in evidence if t and t.strip())
    text = "\n".join(parts)
    sentences: list[str] = []
    for p in parts:
        # Split each message on its own so a sentence never spans two messages.
        sentences.extend(s if s.endswith((" ", "\n")) else s + " " for s in split_sentences(p) if states(s))
    return Premise(text=text, sentences=tuple(sentences))


def word_count(sentence: str) -> float:
    """Words of spaced scripts, plus half a word for each CJK character (a Chinese word is one to two)."""
    return len(_ANY_WORD.findall(sentence)) + len(_CJK_CHAR.findall(sentence)) / 2


def is_question(sentence: str) -> bool:
    return bool(_QUESTION_END.search(sentence.strip()))


def has_fact(sentence: str) -> bool:
    return bool(numbers_in(sentence) or weekdays_in(sentence) or names_in(sentence))


def is_claim(sentence: str) -> bool:
    """Whether an answer's sentence states something: not a question, three words or a fact."""
    s = sentence.strip()
    if not s or is_question(s):
        return False
    return word_count(s) >= 3 or has_fact(s)


def states(sentence: str) -> bool:
    """Whether a premise sentence is evidence: not a question, and a fact or six words.

    "Tell me about it." and "You are a helpful assistant." are requests and roles, not evidence;
    "The meeting is on Tuesday." and a document's sentences are.
    """
    s = sentence.strip()
    if not s or is_question(s):
        return False
    return word_count(s) >= 6 or has_fact(s)


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


def measures_in(text: str) -> dict[str, str]:
    """Each number with what it counts: the word (or the CJK characters) right after it, lowercased
    ("12 million euros" → {"12": "million"}, "1200万元" → {"1200": "万元"}); "" where nothing follows."""
    out: dict[str, str] = {}
    for m in _NUMBER.finditer(text):
        unit = _UNIT.match(text, m.end())
        out[_norm_number(m.group(0).rstrip(","))] = unit.group(1).lower() if unit else ""
    return out


def names_in(text: str) -> set[str]:
    """Capitalised words that are not sentence-initial (or are part of a multi-word name), lowercased.

    A heuristic, documented as such: without a named-entity model shipped in a
    package, capitalisation inside a sentence is the signal used.
    """
    found: set[str] = set()
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
                if len(w) > 1:  # "I" is no name
                    found.add(w)
    return found


def weekdays_in(text: str) -> set[int]:
    """Weekdays named in ``text`` (English names, Chinese 星期二 / 周二 / 礼拜二), 1 (Monday) to 7."""
    days = {_WEEKDAYS_EN.index(m.group(1).lower()) + 1 for m in _WEEKDAY_EN.finditer(text)}
    days.update(_ZH_DAY[m.group(1)] for m in _WEEKDAY_ZH.finditer(text))
    return days


def without_weekdays(text: str) -> str:
    return _WEEKDAY_ZH.sub(" ", _WEEKDAY_EN.sub(" ", text))


def tokens_in(text: str) -> set[str]:
    """Tokens for telling what a sentence is about, in any script: words of four letters or more
    (lowercased; shorter ones are mostly articles, particles and auxiliaries: "the", "was", "and"),
    and for CJK the character pairs (bigrams) of each run, since those scripts put no spaces between
    words."""
    out = {w.lower() for w in _ANY_WORD.findall(text) if len(w) >= 4}
    for run in re.findall(f"[{_CJK}]+", text):
        if len(run) == 1:
            out.add(run)
        out.update(run[i : i + 2] for i in range(len(run) - 1))
    return out


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
