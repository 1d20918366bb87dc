"""ops/runbooks: one page per alert, each complete, with queries, admin calls and bodies that work."""

from __future__ import annotations

import json
import re
import secrets

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.settings import Settings
from tests.conftest import gateway_settings
from tests.harness import GatewayServer
from tests.ops.catalogue import (
    ADMIN_ROUTES_PLANNED,
    ENGINE_METRICS,
    EXPORTED,
    PLANNED,
    PROMETHEUS_SYNTHETIC,
    RUNBOOKS,
    alert_rules,
    metric_names,
    recording_rules,
)

SECTIONS = ("## Meaning", "## Confirm", "## Mitigate", "## Recover")
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
_BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
_ADMIN_CALL = re.compile(r"(?:-X (GET|POST|PUT|DELETE) )?\"\$GW(/admin/[a-z/_-]+)\"")
_ADMIN_KEY = secrets.token_hex(32)  # the boot refuses typed keys


def _blocks(text: str, lang: str) -> list[str]:
    return [body for kind, body in _BLOCK.findall(text) if kind == lang]


def _admin_calls(text: str) -> set[str]:
    calls = set()
    for body in _blocks(text, "sh"):
        for method, path in _ADMIN_CALL.findall(body.replace("\\\n", " ")):
            calls.add(f"{method or 'GET'} {path}")
    return calls


def _admin_requests(text: str) -> list[tuple[str, str, dict | None]]:
    """Each admin call of the page's shell blocks: method, path, and the JSON body it sends."""
    out = []
    for body in _blocks(text, "sh"):
        for line in body.replace("\\\n", " ").splitlines():
            path = re.search(r"\"\$GW(/admin/[a-z/_-]+)\"", line)
            if path is None:
                continue
            method = re.search(r"-X (GET|POST|PUT|DELETE) ", line)
            data = re.search(r"-d '([^']*)'", line)
            sent = json.loads(data.group(1)) if data else None
            out.append((method.group(1) if method else "GET", path.group(1), sent))
    return out


async def _route_exists(call: str) -> bool:
    """Ask the app itself: a route that does not exist gets Starlette's plain 404 (or a 405).

    The app runs without its lifespan here, so a route that exists may fail (500) on the
    resources it would have had; only its existence is asked.
    """
    method, path = call.split(" ", 1)
    settings = Settings(admin={"api_key": _ADMIN_KEY})
    app = create_app(settings, registry=CollectorRegistry())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.request(method, path, headers={"authorization": "Bearer " + _ADMIN_KEY}, json={})
    if r.status_code == 405:
        return False
    return not (
        r.status_code == 404
        and r.json()["error"]
        == {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": "not_found"}
    )


def test_one_page_per_alert_and_no_orphan_pages():
    assert {p.stem for p in PAGES} == set(alert_rules())
    index = (RUNBOOKS / "README.md").read_text()
    for name in alert_rules():
        assert f"({name}.md)" in index, f"README.md does not link {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_page_is_complete(page):
    text = page.read_text()
    assert text.startswith(f"# {page.stem}\n")
    positions = [text.find(s) for s in SECTIONS]
    assert all(p > 0 for p in positions) and positions == sorted(positions), f"sections must be {SECTIONS}"
    severity = alert_rules()[page.stem]["labels"]["severity"]
    assert f"**Severity:** {severity}" in text
    assert _blocks(text, "promql"), "no PromQL to confirm with"
    # Every page says what to do about routing: the commands, or why not to.
    assert "pin" in text and "freeze" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_promql_on_the_page_parses_and_names_real_metrics(page):
    known = EXPORTED | set(PLANNED) | PROMETHEUS_SYNTHETIC | ENGINE_METRICS | set(recording_rules())
    for query in _blocks(page.read_text(), "promql"):
        names = metric_names(query)
        assert names, query
        assert names <= known, f"{page.name}: unknown metrics {sorted(names - known)} in {query!r}"


async def test_admin_calls_name_routes_that_exist_or_are_planned():
    assert await _route_exists("GET /admin/engines")
    assert not await _route_exists("POST /admin/no-such-route")
    used: set[str] = set()
    for page in [*PAGES, RUNBOOKS / "README.md"]:
        used |= _admin_calls(page.read_text())
    assert {
        "POST /admin/routing/pin",
        "POST /admin/routing/freeze",
        "POST /admin/routing/resume",
        "GET /admin/engines",
    } <= used
    for call in sorted(used):
        exists = await _route_exists(call)
        assert exists or call in ADMIN_ROUTES_PLANNED, f"runbooks call {call}, which does not exist"
        if call in ADMIN_ROUTES_PLANNED:
            assert not exists, (
                f"{call} exists now: remove it from ADMIN_ROUTES_PLANNED in tests/ops/catalogue.py "
                "and check the runbooks' request bodies against it"
            )


def test_routing_calls_are_accepted_as_written_by_a_running_gateway(bg, upstreams):
    """Every pin, freeze, unpin, resume, clear and readmit of the runbooks, body as written, against a
    gateway serving the runbooks' model (qwen3-omni-flash on omni-int4 and omni-bf16)."""
    calls = [
        (method, path, body)
        for page in [*PAGES, RUNBOOKS / "README.md"]
        for method, path, body in _admin_requests(page.read_text())
        if path.startswith("/admin/routing/")
    ]
    assert {path for _, path, _ in calls} == {
        f"/admin/routing/{name}" for name in ("pin", "unpin", "freeze", "resume", "clear", "readmit")
    }
    settings = gateway_settings(
        upstreams, admin={"api_key": _ADMIN_KEY}, audit={"enabled": False}, auth={"required": False}
    )
    server = GatewayServer(bg, settings).start()
    headers = {"authorization": "Bearer " + _ADMIN_KEY}
    try:
        for method, path, body in calls:
            assert body is not None, f"{path} is called without a body"
            r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=10)
            if path == "/admin/routing/clear" and r.status_code == 400:
                # The body was understood; no such incident is in force on this gateway.
                error = r.json()["error"]
                assert error["param"] == "incident" and "is in force" in error["message"], error
                continue
            assert r.status_code == 200, (path, body, r.text)
        status = httpx.get(server.url + "/admin/routing", headers=headers, timeout=10).json()
        manual = {t["action"] for t in status["recent_transitions"] if t["source"] == "manual"}
        assert {"pin", "unpin", "freeze", "resume"} <= manual
    finally:
        server.stop()
