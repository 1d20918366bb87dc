"""Refuse weak secrets at start-up: known placeholders anywhere, and low-entropy admin and signing keys.

A config copied from an example must not boot with the example's key, and an admin
or audit-signing key must be one a machine made (``openssl rand -hex 32``), not one a
person typed. The entropy is estimated from the key's own characters (Shannon
entropy of their frequencies times the length): it undercounts a random key a
little and a typed one a lot, which is the direction that matters here.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections import Counter

from gateway.settings import Settings

MIN_LENGTH = 32
MIN_BITS = 100.0
#: how to make a good key, said in every refusal
HOW = "generate one with `openssl rand -hex 32`"

# Words the example files and common templates put where a secret belongs.
_PLACEHOLDER = re.compile(
    r"replace|change[-_ ]?me|changeit|example|placeholder|your[-_ ]|insert[-_ ]|dummy|sample|"
    r"secret|password|passw0rd|letmein|todo|fixme|xxxx",
    re.IGNORECASE,
)


class WeakSecret(ValueError):
    """One or more secrets of the config are placeholders or too weak; each problem names its field."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def estimated_bits(value: str | bytes) -> float:
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    return -n * sum(c / n * math.log2(c / n) for c in counts.values())


def _placeholder(value: str) -> bool:
    return bool(_PLACEHOLDER.search(value))


def _weak_key(field: str, value: str) -> str | None:
    if _placeholder(value):
        return f"{field}: a placeholder value, not a secret ({HOW})"
    if len(value) < MIN_LENGTH:
        return f"{field}: shorter than {MIN_LENGTH} characters ({HOW})"
    if estimated_bits(value) < MIN_BITS:
        return f"{field}: too little entropy, it looks typed rather than generated ({HOW})"
    return None


def problems(settings: Settings) -> list[str]:
    """Every weak secret of ``settings``, each naming its field (the secret itself is never repeated)."""
    found: list[str] = []
    if settings.admin.api_key is not None:
        found.append(_weak_key("admin.api_key", settings.admin.api_key.get_secret_value()) or "")
    signing = settings.audit.signing
    if settings.audit.enabled and signing.key is not None:
        key = signing.key.get_secret_value()
        if signing.algorithm == "hmac-sha256":
            found.append(_weak_key("audit.signing.key", key) or "")
        elif _placeholder(key):
            found.append(f"audit.signing.key: a placeholder value, not a key ({HOW})")
        else:
            try:
                raw = base64.b64decode(key, validate=True)
            except (binascii.Error, ValueError):
                raw = b""
            # An Ed25519 seed is 32 random bytes; a repeated or counting pattern is not one.
            if len(raw) == 32 and estimated_bits(raw) < MIN_BITS:
                found.append(
                    "audit.signing.key: the Ed25519 seed has too little entropy "
                    "(generate one with `openssl rand -base64 32`)"
                )
    for i, e in enumerate(settings.engines):
        if e.api_key is not None and _placeholder(e.api_key.get_secret_value()):
            found.append(f"engines[{i}].api_key: a placeholder value, not the engine's key")
    for dsn_field, dsn in (
        ("audit.postgres_dsn", settings.audit.postgres_dsn),
        ("auth.directory.postgres_dsn", settings.auth.directory.postgres_dsn),
    ):
        if dsn is not None and _placeholder(dsn.get_secret_value().split("@")[0]):
            found.append(f"{dsn_field}: the password is a placeholder value")
    return [p for p in found if p]


def check(settings: Settings) -> None:
    """Raise :class:`WeakSecret` naming every weak secret; the boot, ``check-config`` and reload call it."""
    found = problems(settings)
    if found:
        raise WeakSecret(found)
