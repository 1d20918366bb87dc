"""Console sign-in: a session cookie signed with a key derived from ``admin.api_key``, and its CSRF token.

The cookie reads ``v1.<expires>.<nonce>.<mac>``; the MAC (HMAC-SHA256) is keyed by
HMAC(admin key, a fixed label), so every replica with the same admin key accepts
it without shared session state, and changing the admin key signs every session
out. The CSRF token is a second MAC over the session's nonce: the page carries it,
a cross-site request cannot read it, and each change sent with the cookie must
send it back in ``X-CSRF-Token``. Signing out clears the cookie in the browser; a
copied cookie stays valid until it expires (``admin.console.session_ttl_s``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from starlette.requests import Request

from core.errors import PermissionDenied

COOKIE = "omnigate_console"
CSRF_HEADER = "x-csrf-token"
#: the cookie is sent to the console and the admin API it calls, nowhere else
COOKIE_PATH = "/admin"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LABEL = b"omnigate-console-session-v1"


@dataclass(frozen=True, slots=True)
class Session:
    nonce: str
    expires: int


def _key(admin_key: str) -> bytes:
    return hmac.new(admin_key.encode(), _LABEL, hashlib.sha256).digest()


def _mac(admin_key: str, message: str) -> str:
    return hmac.new(_key(admin_key), message.encode(), hashlib.sha256).hexdigest()


def issue(admin_key: str, ttl_s: float, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + ttl_s)
    body = f"v1.{expires}.{secrets.token_urlsafe(18)}"
    return f"{body}.{_mac(admin_key, body)}"


def read(token: str | None, admin_key: str, now: float | None = None) -> Session | None:
    """The session a cookie value stands for, or None (malformed, forged, signed with another key, expired)."""
    if not token or len(token) > 200:
        return None
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit():
        return None
    body = ".".join(parts[:3])
    if not hmac.compare_digest(parts[3].encode(), _mac(admin_key, body).encode()):
        return None
    expires = int(parts[1])
    if expires <= (time.time() if now is None else now):
        return None
    return Session(parts[2], expires)


def csrf_token(session: Session, admin_key: str) -> str:
    return _mac(admin_key, f"csrf.{session.nonce}")


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
        if not same_origin(request) or not hmac.compare_digest(
            sent.encode(), csrf_token(session, admin_key).encode()
        ):
            raise PermissionDenied(
                "missing or wrong CSRF token for a change made with the console session", code="csrf_failed"
            )
    return session
