"""The audit redactor's former rule set (Python's backtracking ``re``), kept as the oracle for its RE2 rewrite.

Only for short texts: on long adversarial ones it backtracks for minutes.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

_SECRET = re.compile(
    r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}|\b(?:sk|og|pk|rk)[-_][A-Za-z0-9_-]{16,}|\bAKIA[0-9A-Z]{16}\b"
)
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_CARD = re.compile(r"\b\d(?:[ -]?\d){12,18}\b")
_SSN = re.compile(r"\b\d{3}-\d{2}-\d{4}\b")
_PHONE = re.compile(r"(?<![\w+(])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d[\d .-]{4,}\d(?![\w-])")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_IPV6 = re.compile(r"(?i)(?<![\w:])[0-9a-f:]*:[0-9a-f:]*:[0-9a-f:]*(?![\w:])")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _card(m: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", m.group(0))
    return "[CARD]" if 13 <= len(digits) <= 19 and _luhn(digits) else m.group(0)


def _ipv6(m: re.Match[str]) -> str:
    try:
        ipaddress.IPv6Address(m.group(0))
    except ValueError:
        return m.group(0)
    return "[IP]"


def _phone(m: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", m.group(0))
    if _DATE.match(m.group(0)) or not 7 <= len(digits) <= 15:
        return m.group(0)
    return "[PHONE]"


RULES: tuple[tuple[str, re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    ("secrets", _SECRET, "[SECRET]"),
    ("email", _EMAIL, "[EMAIL]"),
    ("iban", _IBAN, "[IBAN]"),
    ("card", _CARD, _card),
    ("us_ssn", _SSN, "[SSN]"),
    ("ipv4", _IPV4, "[IP]"),
    ("ipv6", _IPV6, _ipv6),
    ("phone", _PHONE, _phone),
)


def redact_with_backtracking(text: str) -> str:
    for _name, pattern, repl in RULES:
        text = pattern.sub(repl, text)
    return text
