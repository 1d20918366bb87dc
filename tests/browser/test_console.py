"""The operator console in a real browser: Debian's headless Chromium driven by Selenium, a real gateway.

The gateway runs under uvicorn on its own scripted engines (tests/console_setup.py),
with tenants, keys, SQLite audit and the console on. Each test is one thing an
operator or auditor does, checked on the page and, where it changes something,
through the admin API or a client request. Screenshots go to a temporary folder,
or to ``$OMNIGATE_CONSOLE_SCREENSHOTS`` (the documentation's pictures come from there).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import httpx
import pytest
import yaml
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.console_setup import (
    ADMIN_KEY,
    FAST_RULE,
    OMNI,
    admin,
    chat,
    config,
    request_id,
    start,
    stream_chat,
    tenant_keys,
)
from tests.media import data_uri, plain_image, png
from tests.otlp import Receiver
from tests.trace_view import waterfall
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: a generous bound for what the page shows after a change (it polls every 2 s)
WAIT_S = 20


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("OMNIGATE_CONSOLE_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("console-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def driver():
    # Installed by scripts/test-env.sh; a missing browser is a failed test, not a skipped one.
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), (
        "apt-get install chromium chromium-driver"
    )
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1440,1000",
        "--disable-extensions",
        "--no-first-run",
    ):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def gw(bg, eng, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    keys = tenant_keys()
    doc = config(eng, tmp, keys)
    server = start(bg, doc, tmp / "omnigate.yaml")
    yield server, keys, doc, tmp
    server.stop()


def wait(d, predicate, what: str):
    return WebDriverWait(
        d, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda _: predicate(), message=what)


def open_first_record(d) -> None:
    """Click the first record's link: found and clicked in one try, tried again if the table re-rendered
    in between (the live pages re-render every 2 s, and a stale row cannot be clicked)."""

    def click() -> bool:
        d.find_element(By.CSS_SELECTOR, "#records tbody tr a").click()
        return True

    wait(d, click, "a click on the record's link")


def by_id(d, id_: str):
    return d.find_element(By.ID, id_)


def table_rows(d, table: str) -> list[list[str]]:
    # Read in one script call: the live pages re-render their tables every 2 s.
    return d.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(r => [...r.cells].map(c => c.innerText.trim()))",
        f"#{table} tbody tr",
    )


def sign_in(d, url: str) -> None:
    d.get(url + "/admin/console/overview")
    if d.current_url.endswith("/login"):
        by_id(d, "key").send_keys(ADMIN_KEY)
        by_id(d, "sign-in").click()
        wait(d, lambda: d.current_url.endswith("/overview"), "signed in")


def open_page(d, url: str, page: str) -> None:
    sign_in(d, url)
    d.get(f"{url}/admin/console/{page}")
    wait(d, lambda: d.execute_script("return document.readyState") == "complete", f"{page} loaded")


def choose(d, id_: str, text: str) -> None:
    """Pick an option, again if the page re-rendered the list under the click (it refreshes after changes)."""

    def pick() -> bool:
        Select(by_id(d, id_)).select_by_visible_text(text)
        return Select(by_id(d, id_)).first_selected_option.text == text

    wait(d, pick, f"{text} chosen in {id_}")


def confirm(d) -> None:
    wait(d, lambda: by_id(d, "confirm").is_displayed(), "the confirmation step")
    by_id(d, "confirm-yes").click()


def shot(d, shots: Path, name: str) -> None:
    """The whole page, not just the window: grow the window to the page's height for the picture."""
    height = d.execute_script("return document.documentElement.scrollHeight")
    d.set_window_size(1440, min(max(height, 600) + 140, 4000))
    d.execute_script("window.scrollTo(0, 0)")
    d.save_screenshot(str(shots / f"console-{name}.png"))
    d.set_window_size(1440, 1000)


def test_sign_in_then_the_overview_lists_the_engines(driver, gw, shots):
    server = gw[0]
    driver.delete_all_cookies()
    driver.get(server.url + "/admin/console/overview")
    assert driver.current_url == server.url + "/admin/console/login"
    shot(driver, shots, "login")
    by_id(driver, "key").send_keys("this-is-not-the-admin-key")
    by_id(driver, "sign-in").click()
    wait(driver, lambda: driver.find_elements(By.ID, "login-error"), "the sign-in error")
    assert by_id(driver, "login-error").text == "That is not the admin key."
    by_id(driver, "key").send_keys(ADMIN_KEY)
    by_id(driver, "sign-in").click()
    wait(driver, lambda: driver.current_url.endswith("/admin/console/overview"), "the overview")
    wait(driver, lambda: len(table_rows(driver, "engines")) == 4, "four engines")
    names = [r[0] for r in table_rows(driver, "engines")]
    assert names == ["omni-int4", "omni-bf16", "text-vllm", "spare-vllm"]
    kinds = {r[0]: r[1] for r in table_rows(driver, "engines")}
    assert kinds["omni-int4"] == "vllm-omni" and kinds["text-vllm"] == "vllm"
    wait(driver, lambda: by_id(driver, "admission").text.count("Soft limit") == 1, "the admission state")
    # the cookie is not readable from script (HttpOnly)
    assert driver.execute_script("return document.cookie") == ""


def test_an_engine_goes_unhealthy_when_its_upstream_stops(driver, gw, eng, shots, bg):
    server = gw[0]
    open_page(driver, server.url, "overview")

    def spare() -> list[str]:
        return next((r for r in table_rows(driver, "engines") if r[0] == "spare-vllm"), [""] * 11)

    wait(driver, lambda: spare()[5] == "healthy", "spare healthy at first")
    driver.execute_script("window.notReloaded = true")
    port = eng.spare.port
    bg.run(eng.spare.stop())
    try:
        wait(driver, lambda: spare()[5] == "unhealthy", "spare shown unhealthy")
        row = driver.find_element(By.CSS_SELECTOR, '#engines tr[data-engine="spare-vllm"]')
        assert "bad" in row.get_attribute("class")
        assert driver.execute_script("return window.notReloaded") is True  # live update, no reload
        shot(driver, shots, "overview")
    finally:
        bg.run(eng.spare.start(port=port))
    wait(driver, lambda: spare()[5] == "healthy", "spare healthy again")


def test_pin_a_variant_and_see_the_routing_table_change(driver, gw, shots):
    server = gw[0]
    open_page(driver, server.url, "rollback")

    def omni_rows() -> dict[str, list[str]]:
        return {r[1]: r for r in table_rows(driver, "routing") if r[0] == OMNI}

    wait(driver, lambda: omni_rows().get("omni-int4", [None, None, ""])[2] == "1.00", "int4 serves omni")
    choose(driver, "pin-model", OMNI)
    choose(driver, "pin-variant", "bf16")
    note = "<b>int4 drill</b>"
    by_id(driver, "pin-note").send_keys(note)
    by_id(driver, "pin").click()
    confirm(driver)
    wait(
        driver,
        lambda: omni_rows().get("omni-bf16", [""] * 5)[2:4] == ["1.00", "bf16"],
        "the routing table pinned to bf16",
    )
    assert omni_rows()["omni-int4"][2] == "0.00"
    assert admin(server, "GET", "/routing").json()["pins"] == {OMNI: "bf16"}
    wait(
        driver,
        lambda: table_rows(driver, "transitions") and table_rows(driver, "transitions")[0][2] == "pin",
        "the pin in the history",
    )
    top = table_rows(driver, "transitions")[0]
    assert (
        top[1] == "manual" and top[5] == OMNI and top[8] == f"admin:console-session: {note}"
    )  # markup shown as text
    assert driver.find_elements(By.CSS_SELECTOR, "#transitions b") == []

    by_id(driver, "freeze").click()
    confirm(driver)
    wait(driver, lambda: by_id(driver, "controller-state").text == "frozen", "frozen")
    assert admin(server, "GET", "/routing").json()["frozen"] is True
    shot(driver, shots, "rollback")
    by_id(driver, "resume").click()
    confirm(driver)
    wait(driver, lambda: by_id(driver, "controller-state").text != "frozen", "resumed")
    by_id(driver, "unpin").click()
    by_id(driver, "confirm-no").click()  # cancelled: nothing changes
    assert admin(server, "GET", "/routing").json()["pins"] == {OMNI: "bf16"}
    by_id(driver, "unpin").click()
    confirm(driver)
    wait(driver, lambda: omni_rows()["omni-int4"][2] == "1.00", "unpinned")
    # every change went into the audit trail with its actor and note
    actions = [t["action"] for t in admin(server, "GET", "/routing/transitions").json()["transitions"]]
    assert actions[:4] == ["unpin", "resume", "freeze", "pin"]


def test_an_automatic_rollback_shows_its_rule_signal_and_timing(driver, bg, eng, tmp_path, shots):
    keys = tenant_keys()
    server = start(bg, config(eng, tmp_path, keys, controller=FAST_RULE), tmp_path / "omnigate.yaml")
    try:
        bg.call(lambda: setattr(eng.int4, "default", Script(flavour="omni", first_byte_delay_s=0.3)))
        open_page(driver, server.url, "rollback")

        def fired() -> bool:
            assert stream_chat(server, keys["acme"].key) == 200
            return admin(server, "GET", "/routing").json()["weights"][OMNI]["omni-bf16"] == 1.0

        wait(driver, fired, "the rule moved omni to bf16")
        driver.refresh()
        wait(
            driver,
            lambda: any(r[3] == "int4-latency" for r in table_rows(driver, "transitions")),
            "the automatic transition in the history",
        )
        row = next(r for r in table_rows(driver, "transitions") if r[3] == "int4-latency")
        assert row[1] == "auto" and row[2] == "shift" and row[4] == "omni-int4" and row[5] == OMNI
        signal, took = row[6], row[7]
        assert signal.startswith("ttft_p99 = 0.") and signal.endswith("> 0.15")
        assert float(signal.split()[2]) > 0.15 and took.endswith(" s") and float(took[:-2]) >= 0
        wait(
            driver,
            lambda: (
                {r[1]: r[2] for r in table_rows(driver, "routing") if r[0] == OMNI}
                == {"omni-int4": "0.00", "omni-bf16": "1.00"}
            ),
            "the table after the shift",
        )
        wait(
            driver,
            lambda: [r[0] for r in table_rows(driver, "incidents")] == ["int4-latency@omni-int4"],
            "the incident in force",
        )
        shot(driver, shots, "rollback-auto")
        # freeze (so the rule's last slow samples cannot fire it again) and end it by hand: the rule's
        # change is undone and the restore is in the history
        by_id(driver, "freeze").click()
        confirm(driver)
        wait(driver, lambda: by_id(driver, "controller-state").text == "frozen", "frozen")
        driver.find_element(
            By.CSS_SELECTOR, '#incidents button[data-incident="int4-latency@omni-int4"]'
        ).click()
        confirm(driver)
        wait(driver, lambda: table_rows(driver, "incidents") == [], "no incident left")
        wait(
            driver,
            lambda: any(r[2] == "restore" and r[1] == "manual" for r in table_rows(driver, "transitions")),
            "the manual restore in the history",
        )
        assert admin(server, "GET", "/routing").json()["incidents"] == {}
    finally:
        bg.call(lambda: setattr(eng.int4, "default", Script(flavour="omni")))
        server.stop()


def test_create_and_revoke_a_key_and_see_a_request_with_it_refused(driver, gw, shots):
    server = gw[0]
    open_page(driver, server.url, "tenants")
    wait(driver, lambda: [r[0] for r in table_rows(driver, "tenants")] == ["acme", "globex"], "the tenants")
    by_id(driver, "tenant-name").send_keys("initech")
    choose(driver, "tenant-priority", "batch")
    choose(driver, "tenant-set", "strict")
    by_id(driver, "tenant-rpm").send_keys("120")
    by_id(driver, "tenant-concurrency").send_keys("4")
    choose(driver, "tenant-audit", "redacted")
    by_id(driver, "create-tenant").click()
    wait(driver, lambda: len(table_rows(driver, "tenants")) == 3, "the new tenant listed")
    initech = next(r for r in table_rows(driver, "tenants") if r[0] == "initech")
    assert (
        initech[1:5] == ["admin", "yes", "batch", "strict"]
        and initech[6] == "120"
        and initech[8:10] == ["4", "redacted"]
    )
    made = {t["name"]: t for t in admin(server, "GET", "/tenants").json()["tenants"]}["initech"]
    assert (made["priority"], made["policy_set"], made["max_concurrency"]) == ("batch", "strict", 4)
    assert by_id(driver, "tenant-name").get_attribute("value") == ""  # the form is cleared after a create
    by_id(driver, "tenant-name").send_keys("initech")  # again: the API's 409 is shown, nothing changes
    by_id(driver, "create-tenant").click()
    wait(driver, lambda: by_id(driver, "action-result").text.startswith("409"), "the conflict shown")
    assert by_id(driver, "new-key").is_displayed() is False
    choose(driver, "key-tenant", "acme")
    by_id(driver, "create-key").click()
    wait(driver, lambda: by_id(driver, "new-key").is_displayed(), "the new key, shown once")
    key = by_id(driver, "new-key-value").text
    assert key.startswith("og_")
    key_id = key.split("_")[1]
    wait(driver, lambda: any(r[0] == key_id for r in table_rows(driver, "keys")), "the key in the list")
    assert key not in driver.find_element(By.ID, "keys").text  # the list shows ids, never keys
    assert chat(server, key).status_code == 200
    shot(driver, shots, "tenants")

    driver.find_element(By.CSS_SELECTOR, f'#keys button[data-key="{key_id}"]').click()
    confirm(driver)
    wait(
        driver, lambda: [r[2] for r in table_rows(driver, "keys") if r[0] == key_id] == ["revoked"], "revoked"
    )
    refused = chat(server, key)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    driver.refresh()
    wait(driver, lambda: table_rows(driver, "keys"), "keys after a reload of the page")
    assert by_id(driver, "new-key").is_displayed() is False  # shown once, gone after the page reloads


def test_find_a_requests_audit_record_by_its_id(driver, gw, shots):
    server, keys = gw[0], gw[1]
    rid = request_id(server, keys["acme"].key)
    open_page(driver, server.url, "audit")
    by_id(driver, "f-request_id").send_keys(rid)
    by_id(driver, "search-go").click()

    def found() -> list[list[str]]:
        return [r for r in table_rows(driver, "records") if len(r) > 3 and r[3] == rid]

    wait(driver, lambda: len(table_rows(driver, "records")) == 1 and found(), "exactly the request's record")
    row = found()[0]
    assert row[2] == "request" and row[4] == "acme" and row[6] == "text-vllm" and row[7] == "served"
    open_first_record(driver)
    wait(driver, lambda: by_id(driver, "detail").is_displayed(), "the record's detail")
    assert by_id(driver, "detail-seq").text == row[0]
    head = dict(r for r in table_rows(driver, "detail-head"))
    assert head["Request id"] == rid and head["Key id"] == keys["acme"].id and len(head["Hash"]) == 64
    policies = table_rows(driver, "detail-policies")
    assert policies and policies[0][0] == "request-limits" and policies[0][1] == "pre"
    assert '"admission"' in by_id(driver, "detail-control").text
    assert "text_sha256" in by_id(driver, "detail-digests").text
    export = by_id(driver, "export").get_attribute("href")
    assert export.startswith(server.url + "/admin/audit/export?") and rid in export
    # the export link works with the console's session: one JSON line, the record with its hashes
    lines = driver.execute_script("return fetch(arguments[0]).then(r => r.text())", export).splitlines()
    assert (
        len(lines) == 1
        and json.loads(lines[0])["request_id"] == rid
        and len(json.loads(lines[0])["hash"]) == 64
    )
    shot(driver, shots, "audit")


def test_a_records_page_shows_what_each_guard_saw(driver, bg, eng, tmp_path, shots):
    """The receipt of the NSFW screen on the record's page: the image it scored, at its size as the engine
    got it, and the model's weights digest."""
    keys = tenant_keys()
    doc = config(eng, tmp_path, keys)
    doc["policies"] = {
        "pre": [{"name": n} for n in ("request-limits", "media-fetch", "media-limits", "nsfw-screen")]
    }
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    try:
        image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(320)))}}
        body = {
            "model": OMNI,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}],
        }
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {keys['acme'].key}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert "nsfw-screen=accept" in r.headers["x-omnigate-guards"]
        rid = r.headers["x-request-id"]
        open_page(driver, server.url, "audit")
        by_id(driver, "f-request_id").send_keys(rid)
        by_id(driver, "search-go").click()
        wait(driver, lambda: len(table_rows(driver, "records")) == 1, "the request's record")
        open_first_record(driver)
        wait(driver, lambda: by_id(driver, "detail").is_displayed(), "the record's detail")
        rows = {p[0]: p for p in table_rows(driver, "detail-policies")}
        saw = rows["nsfw-screen"][7]
        assert "image messages.0.content.1: 320x320 px" in saw, saw
        assert "model open-nsfw sha256:" in saw and "threshold 0.8" in saw, saw
        assert rows["request-limits"][7] == ""  # not a screen: no receipt of parts
        shot(driver, shots, "audit-receipt")
    finally:
        server.stop()


def test_a_failed_over_screened_request_as_a_trace_viewer_shows_it(
    driver, bg, eng, tmp_path, shots, monkeypatch
):
    """The trace of a streamed request with an image whose first engine fails before its headers: admission,
    the guards, two engine attempts (the first an error), the audit commit, under the client's span; drawn
    as a waterfall for the documentation (docs/img/trace-failover.png)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    receiver = bg.run(Receiver().start())
    keys = tenant_keys()
    doc = config(eng, tmp_path, keys)
    doc["policies"] = {
        "pre": [
            {"name": n}
            for n in ("load-shedding", "request-limits", "media-fetch", "media-limits", "nsfw-screen")
        ]
    }
    doc["tracing"] = {"enabled": "on", "endpoint": receiver.url}
    server = start(bg, doc, tmp_path / "omnigate.yaml")
    trace = "9a1c4e5f6b7d8e9fa0b1c2d3e4f5a6b7"
    try:
        eng.int4.enqueue(Script(flavour="omni", fault="500_before_headers"))
        image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(320)))}}
        body = {
            "model": OMNI,
            "stream": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}],
        }
        headers = {
            "authorization": f"Bearer {keys['acme'].key}",
            "traceparent": f"00-{trace}-00f067aa0ba902b7-01",
        }
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            "".join(r.iter_text())

        def complete() -> bool:
            names = [s.name for s in receiver.of_trace(trace)]
            return names.count("chat omni-int4") == 1 and "POST /v1/chat/completions" in names

        wait(driver, complete, "the trace exported")
    finally:
        server.stop()
        bg.run(receiver.stop())
    spans = receiver.of_trace(trace)
    names = [s.name for s in spans]
    assert {"admission", "apply_guardrail nsfw-screen", "chat omni-bf16", "audit commit"} <= set(names)
    failed = next(s for s in spans if s.name == "chat omni-int4")
    assert failed.status == 2
    page = tmp_path / "trace.html"
    page.write_text(waterfall(spans, "POST /v1/chat/completions: screened, failed over from INT4 to BF16"))
    driver.get(page.as_uri())
    wait(driver, lambda: len(table_rows_all(driver)) == len(spans), "the waterfall drawn")
    driver.set_window_size(1440, 200 + 30 * len(spans))
    driver.save_screenshot(str(shots / "trace-failover.png"))
    driver.set_window_size(1440, 1000)


def table_rows_all(d) -> list[str]:
    return d.execute_script("return [...document.querySelectorAll('tr')].map(r => r.innerText)")


def test_redacted_content_is_shown_redacted_and_as_text(driver, gw):
    server = gw[0]
    assert (
        admin(server, "POST", "/tenants", json={"name": "redactco", "audit_content": "redacted"}).status_code
        == 201
    )
    key = admin(server, "POST", "/keys", json={"tenant": "redactco"}).json()["key"]
    prompt = 'mail ana@example.com <img src=x id=injected onerror="document.title=1">'
    rid = request_id(server, key, content=prompt)
    open_page(driver, server.url, "audit")
    by_id(driver, "f-request_id").send_keys(rid)
    by_id(driver, "search-go").click()
    wait(driver, lambda: len(table_rows(driver, "records")) == 1, "the record")
    open_first_record(driver)
    wait(driver, lambda: "[EMAIL]" in by_id(driver, "detail-content").text, "the redacted content")
    kept = by_id(driver, "detail-content").text
    assert "ana@example.com" not in kept and "<img src=x" in kept  # redacted, and markup shown as characters
    assert driver.find_elements(By.ID, "injected") == [] and driver.title != "1"


def _copy_and_break(live: Path, copy: Path, seq: int) -> None:
    src = sqlite3.connect(live)
    dst = sqlite3.connect(copy)
    src.backup(dst)  # a consistent copy of the live, WAL-mode database
    src.close()
    dst.execute(
        "UPDATE audit_log SET data = replace(data, '\"status\":200', '\"status\":204') WHERE seq = ?", (seq,)
    )
    dst.commit()
    dst.close()


def test_break_a_copy_of_the_chain_and_see_verify_point_at_the_record(driver, gw, shots, bg, eng):
    server, keys, doc, tmp = gw
    for _ in range(3):
        assert chat(server, keys["globex"].key).status_code == 200
    requests = admin(server, "GET", "/audit/records", params={"kind": "request", "tenant": "globex"}).json()
    target = requests["records"][1]["seq"]
    head = admin(server, "GET", "/audit/records", params={"limit": 1}).json()["records"][0]["seq"]
    copy_dir = tmp / "copy"
    copy_dir.mkdir()
    _copy_and_break(Path(doc["audit"]["sqlite_path"]), copy_dir / "audit.db", target)
    copy_doc = {**doc, "audit": {**doc["audit"], "sqlite_path": str(copy_dir / "audit.db")}}
    auditor = start(bg, copy_doc, copy_dir / "omnigate.yaml")
    try:
        open_page(driver, auditor.url, "audit")
        by_id(driver, "v-from").clear()
        by_id(driver, "v-from").send_keys("1")
        by_id(driver, "v-to").clear()
        by_id(driver, "v-to").send_keys(str(head))
        by_id(driver, "verify").click()
        wait(driver, lambda: "breaks" in by_id(driver, "verify-result").text, "the verify result")
        text = by_id(driver, "verify-result").text
        assert f"breaks at record {target} (edited)" in text and f"record {target} was edited" in text
        by_id(driver, "broken-record").click()
        wait(driver, lambda: by_id(driver, "detail-seq").text == str(target), "the broken record's detail")
        assert dict(table_rows(driver, "detail-head"))["Outcome"].startswith(
            "served (204"
        )  # the edit, on show
        shot(driver, shots, "audit-verify")
        # the range before the edit verifies, and the live chain is intact
        by_id(driver, "v-to").clear()
        by_id(driver, "v-to").send_keys(str(target - 1))
        by_id(driver, "verify").click()
        wait(driver, lambda: "intact" in by_id(driver, "verify-result").text, "the earlier range verifies")
    finally:
        auditor.stop()
    assert admin(server, "GET", "/audit/verify").json()["ok"] is True


def test_configuration_page_and_a_check_before_reload(driver, gw, shots):
    server = gw[0]
    open_page(driver, server.url, "config")
    wait(driver, lambda: len(table_rows(driver, "chains")) == 2, "the policy chains")
    chains = {r[0]: r for r in table_rows(driver, "chains")}
    assert (
        chains["policies (default)"][1] == "request-limits → media-fetch → media-limits"
        and "policy_sets.strict" in chains
    )
    tenants = {r[0]: r[3] for r in table_rows(driver, "tenant-chains")}
    assert tenants["acme"] == "policies (default)" and tenants["globex"] == "policy_sets.strict"
    assert [r[0] for r in table_rows(driver, "engine-config")] == [
        "omni-int4",
        "omni-bf16",
        "text-vllm",
        "spare-vllm",
    ]
    by_id(driver, "check").click()
    wait(driver, lambda: "Check:" in by_id(driver, "check-result").text, "the check result")
    assert "the file is valid" in by_id(driver, "check-result").text
    shot(driver, shots, "config")

    # Reload shows the validation first: a broken file is refused before any dialog, nothing swapped
    path = gw[3] / "omnigate.yaml"
    good = path.read_text()
    doc = yaml.safe_load(good)
    path.write_text(yaml.safe_dump({**doc, "tenants": [*doc["tenants"], {"name": "bad", "priority": "vip"}]}))
    by_id(driver, "reload").click()
    wait(driver, lambda: "refused" in by_id(driver, "check-result").text, "the refusal")
    assert "priority" in by_id(driver, "check-result").text and not by_id(driver, "confirm").is_displayed()
    # a valid change: the dialog says what it applies, and only the confirmation swaps it in
    path.write_text(yaml.safe_dump({**doc, "tenants": [*doc["tenants"], {"name": "umbrella"}]}))
    by_id(driver, "reload").click()
    wait(driver, lambda: by_id(driver, "confirm").is_displayed(), "the confirmation with the check's result")
    assert "Applies at once: tenants" in by_id(driver, "confirm-text").text
    assert "umbrella" not in {t["name"] for t in admin(server, "GET", "/tenants").json()["tenants"]}
    by_id(driver, "confirm-yes").click()
    wait(driver, lambda: "Reload: reloaded" in by_id(driver, "check-result").text, "the reload result")
    wait(driver, lambda: "umbrella" in [r[0] for r in table_rows(driver, "tenant-chains")], "the new tenant")
    path.write_text(good)


def test_every_page_talks_only_to_the_gateway_and_breaks_no_policy(driver, gw):
    """What the browser fetched on each page (its network log) and what it complained about (its console)."""
    server = gw[0]
    sign_in(driver, server.url)
    driver.get_log("performance")
    driver.get_log("browser")  # start both logs afresh
    for page in ("overview", "rollback", "tenants", "audit", "config"):
        open_page(driver, server.url, page)
        driver.execute_script("return new Promise(r => setTimeout(r, 500))")  # let its first fetches finish
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    assert (
        urls and any("/admin/routing" in u for u in urls) and any("/admin/audit/records" in u for u in urls)
    )
    # data: URLs are the browser's own (the date picker's icon), not requests to a host
    elsewhere = [u for u in urls if not u.startswith((server.url + "/", "data:"))]
    assert elsewhere == []
    complaints = [
        e["message"]
        for e in driver.get_log("browser")
        if e["level"] in ("SEVERE", "WARNING") and "favicon.ico" not in e["message"]
    ]
    assert complaints == []  # no Content-Security-Policy violation, no script error, no failed fetch


def test_sign_out(driver, gw):
    server = gw[0]
    open_page(driver, server.url, "overview")
    by_id(driver, "sign-out").click()
    wait(driver, lambda: driver.current_url.endswith("/login"), "the sign-in page")
    driver.get(server.url + "/admin/console/audit")
    assert driver.current_url.endswith("/login")
    assert httpx.get(server.url + "/admin/engines", timeout=5).status_code == 401
