"""Console sign-in: a session cookie signed with a key derived from ``admin.api_key``, and its CSRF token.

The cookie is an itsdangerous ``URLSafeSerializer`` token of ``{"n": nonce, "e":
expires}``, signed (HMAC-SHA256) with the admin key under a fixed salt, so every
replica with the same admin key accepts it without shared session state, and
changing the admin key signs every session out. The CSRF token is a second
signature, under another salt, over the session's nonce: the page carries it, a
cross-site request cannot read it, and each change sent with the cookie must send
it back in ``X-CSRF-Token``. Signing out clears the cookie in the browser; a copied
cookie stays valid until it expires (``admin.console.session_ttl_s``).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadSignature, Signer, URLSafeSerializer
from starlette.requests import Request

from core.errors import PermissionDenied

COOKIE = "omnigate_console"
CSRF_HEADER = "x-csrf-token"
#: the cookie is sent to the console and the admin API it calls, nowhere else
COOKIE_PATH = "/admin"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SESSION_SALT = "omnigate-console-session-v1"
_CSRF_SALT = "omnigate-console-csrf-v1"
#: a cookie longer than this was not issued here; it is refused before its signature is checked
_MAX_TOKEN = 200
#: HMAC-SHA256, keyed by HMAC(admin key, salt)
_SIGNER: dict[str, Any] = {"digest_method": hashlib.sha256, "key_derivation": "hmac"}


@dataclass(frozen=True, slots=True)
class Session:
    nonce: str
    expires: int


def _serializer(admin_key: str) -> URLSafeSerializer:
    return URLSafeSerializer(admin_key, salt=_SESSION_SALT, signer_kwargs=_SIGNER)


def _csrf_signer(admin_key: str) -> Signer:
    return Signer(admin_key, salt=_CSRF_SALT, **_SIGNER)


def issue(admin_key: str, ttl_s: float, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + ttl_s)
    return _serializer(admin_key).dumps({"n": secrets.token_urlsafe(18), "e": expires})


def read(token: str | None, admin_key: str, now: float | None = None) -> Session | None:
    """The session a cookie value stands for, or None (malformed, forged, signed with another key, expired)."""
    if not token or len(token) > _MAX_TOKEN:
        return None
    try:
        data = _serializer(admin_key).loads(token)
    except BadSignature:
        return None
    if not isinstance(data, dict):
        return None
    nonce, expires = data.get("n"), data.get("e")
    # bool is an int: a signed {"e": true} was not issued here either
    if not isinstance(nonce, str) or not isinstance(expires, int) or isinstance(expires, bool):
        return None
    if expires <= (time.time() if now is None else now):
        return None
    return Session(nonce, expires)


def csrf_token(session: Session, admin_key: str) -> str:
    return _csrf_signer(admin_key).get_signature(session.nonce).decode()


def same_origin(request: Request) -> bool:
    """False when the browser says the request came from another origin (``Origin`` is sent on changes)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


def from_request(request: Request, admin_key: str) -> Session | None:
    """The console session that authenticates this request, or None; a change without its CSRF token is refused."""
    session = read(request.cookies.get(COOKIE), admin_key)
    if session is None:
        return None
    if request.method not in SAFE_METHODS:
        sent = request.headers.get(CSRF_HEADER, "")
        if not same_origin(request) or not _csrf_signer(admin_key).verify_signature(session.nonce, sent):
            raise PermissionDenied(
                "missing or wrong CSRF token for a change made with the console session", code="csrf_failed"
            )
    return session
