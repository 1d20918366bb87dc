"""API keys and the tenants they belong to: minting, hashing and resolving a Bearer key.

A key reads ``og_<id>_<secret>``: ``id`` (12 characters) is public and finds the
key; ``secret`` is 32 random bytes. Only SHA-256 of the whole key is stored. A
slow password hash (scrypt, argon2) buys nothing here: it protects guessable
passwords, while a 256-bit random secret cannot be guessed from its digest, and
a fast digest keeps authentication in microseconds.

The :class:`Directory` is an immutable snapshot (config plus the tenant directory,
see :mod:`gateway.directory`) swapped whole on reload, after an admin change or a
refresh; the request path only reads it. Whether a key is required at all is the
config's decision (``Settings.auth_required``), never the number of tenants: with
none, every request is refused. A directory key is refused once the directory has
not been read for ``fail_closed_after_s`` (config keys keep working).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from core.errors import AuthenticationFailed, DirectoryUnavailable
from core.settings import TenantConfig
from gateway.settings import ApiKeyConfig, Settings

KEY_PREFIX = "og_"
_ID_LEN = 12
_ID_ALPHABET = string.ascii_lowercase + string.digits
Source = Literal["config", "admin"]

#: One message for every failure, so a client learns nothing about which keys exist.
_BAD_KEY = "Incorrect API key provided. You can find your API key in your omnigate tenant settings."


class KeyRefused(AuthenticationFailed):
    """An authentication failure with a bounded ``reason`` label for metrics (never shown to clients)."""

    def __init__(self, reason: str, key_id: str | None = None) -> None:
        super().__init__(_BAD_KEY)
        self.reason = reason
        self.key_id = key_id


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MintedKey:
    id: str
    key: str  # shown once, never stored
    sha256: str


def mint_key() -> MintedKey:
    key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LEN))
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return MintedKey(key_id, key, key_digest(key))


def key_id_of(token: str) -> str | None:
    """The public id inside a well-formed key, or None."""
    if not token.startswith(KEY_PREFIX) or len(token) < len(KEY_PREFIX) + _ID_LEN + 2 or len(token) > 256:
        return None
    key_id = token[len(KEY_PREFIX) : len(KEY_PREFIX) + _ID_LEN]
    if token[len(KEY_PREFIX) + _ID_LEN] != "_" or not all(c in _ID_ALPHABET for c in key_id):
        return None
    return key_id


@dataclass(frozen=True, slots=True)
class KeyEntry:
    id: str
    tenant: str
    sha256: str
    enabled: bool
    source: Source
    created_at: str | None = None


@dataclass(frozen=True, slots=True)
class TenantEntry:
    config: TenantConfig
    source: Source


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the resolved tenant and the key's public id."""

    tenant: TenantConfig
    key_id: str


@dataclass(frozen=True, slots=True)
class Directory:
    tenants: Mapping[str, TenantEntry] = field(default_factory=dict)
    keys: Mapping[str, KeyEntry] = field(default_factory=dict)
    #: when the directory store was last read successfully (time.monotonic); None: never
    read_at: float | None = None
    #: directory keys are refused once ``read_at`` is older than this
    fail_closed_after_s: float = 30.0

    @classmethod
    def build(
        cls,
        settings: Settings,
        db_tenants: list[TenantConfig] = (),  # type: ignore[assignment]
        db_keys: list[KeyEntry] = (),  # type: ignore[assignment]
        read_at: float | None = None,
    ) -> Directory:
        """Config entries win over database ones of the same name (the file is the operator's word)."""
        tenants: dict[str, TenantEntry] = {t.name: TenantEntry(t, "admin") for t in db_tenants}
        tenants.update({t.name: TenantEntry(t, "config") for t in settings.tenants})
        keys: dict[str, KeyEntry] = {k.id: k for k in db_keys if k.tenant in tenants}
        keys.update({k.id: _from_config(k) for k in settings.api_keys})
        return cls(tenants, keys, read_at, settings.auth.directory.fail_closed_after_s)

    def stale(self, now: float | None = None) -> bool:
        """True when directory keys are refused: the store has not been read for too long."""
        if self.read_at is None:
            return True
        return (time.monotonic() if now is None else now) - self.read_at > self.fail_closed_after_s

    def authenticate(self, authorization: str | None, now: float | None = None) -> Principal:
        """Resolve an ``Authorization`` header; raise :class:`KeyRefused` otherwise."""
        if not authorization:
            raise KeyRefused("missing")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise KeyRefused("missing")
        key_id = key_id_of(token)
        entry = self.keys.get(key_id) if key_id else None
        # Compare against a digest even when the id is unknown, so timing says nothing either.
        expected = entry.sha256 if entry is not None else "0" * 64
        if not hmac.compare_digest(key_digest(token), expected) or entry is None:
            raise KeyRefused("invalid")
        tenant = self.tenants.get(entry.tenant)
        if not entry.enabled or tenant is None or not tenant.config.enabled:
            raise KeyRefused("disabled", key_id=entry.id)
        if entry.source == "admin" and self.stale(now):
            # Only after the secret matched: a revocation this replica cannot see may be pending.
            raise DirectoryUnavailable(
                "the tenant directory cannot be read right now; try again shortly", retry_after=5
            )
        return Principal(tenant.config, entry.id)


def _from_config(k: ApiKeyConfig) -> KeyEntry:
    return KeyEntry(k.id, k.tenant, k.sha256, k.enabled, "config")
