"""PII redaction for prompt and output text the audit is configured to keep (``audit_content: redacted``).

A fixed, documented rule set, applied in this order (each match is replaced by its tag):

======================  ===============================================================  ==============
rule                    matches                                                          replaced by
======================  ===============================================================  ==============
secrets                 Bearer tokens, ``sk-``/``og_``-style API keys, AWS access key ids  ``[SECRET]``
email                   ``local@domain.tld``                                             ``[EMAIL]``
iban                    two letters, two digits, 11-30 alphanumerics (grouping allowed)  ``[IBAN]``
card                    13-19 digits (spaces or dashes allowed) passing the Luhn check   ``[CARD]``
us_ssn                  ``ddd-dd-dddd``                                                  ``[SSN]``
phone                   7-15 digits, with ``+`` country code, ``(area)``, separators;   ``[PHONE]``
                        ISO dates are left alone
ipv4, ipv6              IP addresses                                                     ``[IP]``
======================  ===============================================================  ==============

Names and postal addresses need a language model to find reliably; they are not
redacted. Tenants that must not keep such text keep ``digests`` only.

The patterns run on RE2 (google-re2), whose matching time is linear in the text:
a backtracking engine spends cubic time on a run of colons or digits built to
defeat a pattern, and it holds the GIL meanwhile, so one prompt of a kilobyte
could stall the whole gateway. RE2 has no look-arounds; a rule that needs one
matches the neighbouring character (or the text's edge) as an extra piece around
its group 1, and the scan resumes at the end of group 1, so the neighbour stays
available to the next match exactly as a look-around would leave it. The text is
scanned as UTF-8 bytes, encoded once (str offsets would be re-derived per search).

What one record may spend is capped by size: at most :data:`MAX_REDACTED_CHARS`
characters of a record are redacted and kept; the rest is replaced by a marker
saying how much was not kept (never kept unredacted).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import re2

#: characters of one record's text that are redacted and kept; the rest is dropped (see the module docstring)
MAX_REDACTED_CHARS = 256 * 1024

# Unicode letters, digits and "_": what a backtracking engine's \w means for str (RE2's \w is ASCII only).
_W = r"\pL\pN_"


def _rx(pattern: str) -> re2._Regexp:
    return re2.compile(pattern.encode())


_SECRET = _rx(
    r"((?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}|\b(?:sk|og|pk|rk)[-_][A-Za-z0-9_-]{16,}|\bAKIA[0-9A-Z]{16}\b)"
)
_EMAIL = _rx(r"(\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b)")
_IBAN = _rx(r"(\b[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11,30}\b)")
_CARD = _rx(r"(\b[0-9](?:[ -]?[0-9]){12,18}\b)")
_SSN = _rx(r"(\b[0-9]{3}-[0-9]{2}-[0-9]{4}\b)")
# (?<![\w+(]) before and (?![\w-]) after, as matched neighbours
_PHONE = _rx(
    rf"(?:^|[^{_W}+(])((?:\+[0-9]{{1,3}}[ .-]?)?(?:\([0-9]{{1,4}}\)[ .-]?)?[0-9][0-9 .-]{{4,}}[0-9])(?:[^{_W}-]|$)"
)
_IPV4 = _rx(r"(\b(?:(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\b)")
# (?<![\w:]) before and (?![\w:]) after, as matched neighbours
_IPV6 = _rx(rf"(?:^|[^{_W}:])((?i)[0-9a-f:]*:[0-9a-f:]*:[0-9a-f:]*)(?:[^{_W}:]|$)")
_DATE = _rx(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


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


def _digits(s: str) -> str:
    return "".join(c for c in s if "0" <= c <= "9")


def _card(found: str) -> str:
    digits = _digits(found)
    return "[CARD]" if 13 <= len(digits) <= 19 and _luhn(digits) else found


def _ipv6(found: str) -> str:
    try:
        ipaddress.IPv6Address(found)
    except ValueError:
        return found
    return "[IP]"


def _phone(found: str) -> str:
    if _DATE.search(found.encode()) or not 7 <= len(_digits(found)) <= 15:
        return found
    return "[PHONE]"


Replacement = str | Callable[[str], str]

RULES: tuple[tuple[str, re2._Regexp, Replacement], ...] = (
    ("secrets", _SECRET, "[SECRET]"),
    ("email", _EMAIL, "[EMAIL]"),
    ("iban", _IBAN, "[IBAN]"),
    ("card", _CARD, _card),
    ("us_ssn", _SSN, "[SSN]"),
    ("ipv4", _IPV4, "[IP]"),
    ("ipv6", _IPV6, _ipv6),
    ("phone", _PHONE, _phone),
)


def _apply(pattern: re2._Regexp, repl: Replacement, text: bytes) -> bytes:
    """Replace every group-1 match, resuming each search where group 1 ended (see the module docstring)."""
    out: list[bytes] = []
    last = pos = 0
    end = len(text)
    while pos <= end:
        m = pattern.search(text, pos)
        if m is None:
            break
        start, stop = m.span(1)
        if isinstance(repl, str):
            new = repl.encode()
        else:
            found = text[start:stop].decode("utf-8", "surrogatepass")
            new = repl(found).encode("utf-8", "surrogatepass")
        out.append(text[last:start])
        out.append(new)
        last = stop
        pos = stop if stop > start else stop + 1
    if not out:
        return text
    out.append(text[last:])
    return b"".join(out)


def redact(text: str, limit: int = MAX_REDACTED_CHARS) -> str:
    """The text with every rule applied; beyond ``limit`` characters, a marker instead of the rest."""
    over = len(text) - limit
    if over > 0:
        text = text[:limit]
    data = text.encode("utf-8", "surrogatepass")
    for _name, pattern, repl in RULES:
        data = _apply(pattern, repl, data)
    kept = data.decode("utf-8", "surrogatepass")
    return kept + f"[NOT KEPT: {over} more characters]" if over > 0 else kept


class Budget:
    """What one record may still have redacted and kept, shared by its messages and its output."""

    __slots__ = ("left",)

    def __init__(self, chars: int = MAX_REDACTED_CHARS) -> None:
        self.left = chars

    def redact(self, text: str) -> str:
        limit = max(0, self.left)
        self.left -= min(len(text), limit)
        return redact(text, limit)
