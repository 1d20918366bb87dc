"""The console's routes under ``/admin/console``: sign-in, sign-out, the pages and their two static files.

Pages are shells rendered with Jinja2 (autoescaped); the data in them comes from
the admin API, fetched by ``static/console.js`` with the session cookie. Every
response carries a Content-Security-Policy that allows scripts, styles, images
and fetches from this origin only, no inline script, no framing. With
``admin.console.enabled`` false (the default) every route here answers 404.
"""

from __future__ import annotations

import asyncio
import hmac
from importlib import resources
from urllib.parse import parse_qs

import structlog
from fastapi import APIRouter, Request
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from core.errors import AuthenticationFailed, PayloadTooLarge, PermissionDenied, RequestTimeout
from gateway.api import console_session as session
from gateway.api.admin import AdminDisabled
from gateway.api.auth import client_address
from gateway.services import Services

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/admin/console", include_in_schema=False)

#: the pages, in the order of the navigation bar
PAGES = {
    "overview": "Overview",
    "rollback": "Rollback",
    "tenants": "Tenants and keys",
    "audit": "Audit",
    "config": "Configuration",
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # no-referrer would make Chromium send "Origin: null" on the sign-in form, which same_origin refuses
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}
_STATIC = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
_MAX_FORM = 4096

_env = Environment(
    loader=PackageLoader("gateway.console", "templates"), autoescape=select_autoescape(["html"])
)


def _admin_key(request: Request) -> str:
    services: Services = request.app.state.services
    admin = services.settings.admin
    if not admin.console.enabled or admin.api_key is None:
        raise AdminDisabled("Not Found")
    return admin.api_key.get_secret_value()


def _render(name: str, status: int = 200, **ctx: object) -> HTMLResponse:
    html = _env.get_template(name).render(pages=PAGES, **ctx)
    return HTMLResponse(html, status_code=status, headers={**SECURITY_HEADERS, "cache-control": "no-store"})


def _set_cookie(response: Response, request: Request, value: str, max_age: int) -> None:
    response.set_cookie(
        session.COOKIE,
        value,
        max_age=max_age,
        path=session.COOKIE_PATH,
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )


@router.get("")
async def index(request: Request) -> Response:
    _admin_key(request)
    return RedirectResponse(request.url_for("console_page", page="overview").path, status_code=303)


@router.get("/login")
async def login_form(request: Request) -> HTMLResponse:
    _admin_key(request)
    return _render("login.html")


@router.post("/login")
async def login(request: Request) -> Response:
    key = _admin_key(request)
    if not session.same_origin(request):
        raise PermissionDenied("sign-in from another origin is refused", code="csrf_failed")
    services: Services = request.app.state.services
    services.auth_failures.check(client_address(request))  # before the key is compared: see auth_failures
    body = b""
    timeout_s = services.settings.server.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):  # a form trickled in byte by byte holds no connection for long
            async for chunk in request.stream():
                body += chunk
                if len(body) > _MAX_FORM:
                    raise PayloadTooLarge(f"the sign-in form is limited to {_MAX_FORM} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the sign-in form did not arrive within {timeout_s:g} s") from None
    given = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0]
    if not hmac.compare_digest(given.encode(), key.encode()):
        services.metrics.auth_failures.labels("console_sign_in").inc()
        log.warning("console_sign_in_failed")
        if services.auth_failures is not None:
            # The same per-address limit as a refused API or admin key: the form is no free guess.
            await services.auth_failures.failed(client_address(request), "console_sign_in")
        return _render("login.html", status=401, error="That is not the admin key.")
    ttl = int(services.settings.admin.console.session_ttl_s)
    response = RedirectResponse(request.url_for("console_page", page="overview").path, status_code=303)
    _set_cookie(response, request, session.issue(key, ttl), ttl)
    log.info("console_signed_in")
    if services.audit is not None:
        await services.audit.append_event("admin_change", {"action": "console_signed_in"})
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    key = _admin_key(request)
    if session.from_request(request, key) is None:
        raise AuthenticationFailed("not signed in to the console")
    response = JSONResponse({"signed_out": True}, headers=SECURITY_HEADERS)
    _set_cookie(response, request, "", 0)
    return response


@router.get("/static/{name}")
async def static(request: Request, name: str) -> Response:
    _admin_key(request)
    media = _STATIC.get(name)
    if media is None:
        raise AdminDisabled("Not Found")
    data = resources.files("gateway.console").joinpath("static", name).read_bytes()
    return Response(data, media_type=media, headers={**SECURITY_HEADERS, "cache-control": "no-cache"})


@router.get("/{page}", name="console_page")
async def page(request: Request, page: str) -> Response:
    key = _admin_key(request)
    if page not in PAGES:
        raise AdminDisabled("Not Found")
    current = session.from_request(request, key)
    if current is None:
        return RedirectResponse(request.url_for("login_form").path, status_code=303)
    return _render(f"{page}.html", page=page, title=PAGES[page], csrf=session.csrf_token(current, key))
