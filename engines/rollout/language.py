"""Which language a transcript is in, as far as the accuracy sentinel needs to know: a conservative rule.

The sentinel's ASR model (whisper tiny.en) hears English only, so the one question
that matters is whether a transcript is English; a wrong "yes" would score Chinese
speech against an English listener and roll INT4 back for nothing, a wrong "no" only
leaves an answer unscored. So the rule says "en" only on clear evidence, without a
statistical detector (and the dependency it would bring):

* by script: letters of a script other than Latin (Han, kana, Hangul, Cyrillic, Arabic,
  Devanagari, ...) make up at least ``_OTHER_SCRIPT_SHARE`` of the letters: the
  script's language where one script means one language (Han without kana: zh; kana:
  ja; Hangul: ko; Thai: th; Greek: el; Hebrew: he), else undetermined;
* Latin script: English when letters outside ASCII are rare (accents mark French,
  Spanish, German, Vietnamese, ...) and English function words ("the", "and", "is",
  ...) make up at least ``_FUNCTION_SHARE`` of the words; anything else is undetermined.

Undetermined is never scored.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_OTHER_SCRIPT_SHARE = 0.2
_NON_ASCII_LATIN_SHARE = 0.02
_FUNCTION_SHARE = 0.12

# The commonest English function words: a Latin-script sentence in another language rarely has many.
_ENGLISH = frozenset(
    [
        "a",
        "about",
        "after",
        "all",
        "also",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "been",
        "before",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "for",
        "from",
        "had",
        "has",
        "have",
        "he",
        "her",
        "here",
        "him",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "just",
        "me",
        "my",
        "no",
        "not",
        "now",
        "of",
        "on",
        "or",
        "our",
        "out",
        "she",
        "so",
        "some",
        "than",
        "that",
        "the",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "to",
        "up",
        "us",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "will",
        "with",
        "would",
        "you",
        "your",
    ]
)
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")

# Unicode character-name prefixes of the scripts told apart, and the one language each means (None: several).
_SCRIPTS: tuple[tuple[str, str, str | None], ...] = (
    ("CJK UNIFIED IDEOGRAPH", "han", "zh"),
    ("CJK COMPATIBILITY IDEOGRAPH", "han", "zh"),
    ("HIRAGANA", "kana", "ja"),
    ("KATAKANA", "kana", "ja"),
    ("HANGUL", "hangul", "ko"),
    ("CYRILLIC", "cyrillic", None),
    ("ARABIC", "arabic", None),
    ("HEBREW", "hebrew", "he"),
    ("DEVANAGARI", "devanagari", None),
    ("THAI", "thai", "th"),
    ("GREEK", "greek", "el"),
)


@dataclass(frozen=True, slots=True)
class Detected:
    #: a language tag ("en", "zh", ...) or None: undetermined
    language: str | None
    #: the transcript's main script ("latin", "han", ...; "none": no letters)
    script: str


def _script(ch: str) -> str:
    if ch.isascii():
        return "latin"
    name = unicodedata.name(ch, "")
    if name.startswith("LATIN"):
        return "latin-ext"
    for prefix, script, _ in _SCRIPTS:
        if name.startswith(prefix):
            return script
    return "other"


_UNSPACED = frozenset({"han", "kana", "thai"})


def long_enough(text: str, min_words: int) -> bool:
    """At least ``min_words`` words; in scripts written without spaces (Han, kana, Thai), two letters a word."""
    if len(text.split()) >= min_words:
        return True
    return sum(1 for c in text if c.isalpha() and _script(c) in _UNSPACED) >= 2 * min_words


def detect(text: str) -> Detected:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return Detected(None, "none")
    counts: dict[str, int] = {}
    for c in letters:
        s = _script(c)
        counts[s] = counts.get(s, 0) + 1
    latin = counts.get("latin", 0) + counts.get("latin-ext", 0)
    other = len(letters) - latin
    if other / len(letters) >= _OTHER_SCRIPT_SHARE:
        rest = {s: n for s, n in counts.items() if s not in ("latin", "latin-ext")}
        if "kana" in rest:
            return Detected("ja", "kana")
        main = max(rest, key=lambda s: rest[s])
        language = next((lang for _, script, lang in _SCRIPTS if script == main), None)
        return Detected(language, main)
    if counts.get("latin-ext", 0) / max(1, latin) > _NON_ASCII_LATIN_SHARE:
        return Detected(None, "latin")
    words = [w.lower() for w in _WORD.findall(text)]
    if not words:
        return Detected(None, "latin")
    function = sum(1 for w in words if w in _ENGLISH)
    if function / len(words) >= _FUNCTION_SHARE:
        return Detected("en", "latin")
    return Detected(None, "latin")
