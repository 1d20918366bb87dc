"""A tenant whose audit keeps redacted content sends prompts built to make redaction backtrack.

Redaction runs on the audit writer's thread but holds the GIL while it matches, so
a backtracking engine would stall the whole process: health checks included. With
RE2 the prompts are recorded (redacted) and the health checks keep being answered.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.tenants import mint_key
from tests.conftest import TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer

pytestmark = pytest.mark.timeout(120)

# 1 KB each, as a tenant could send them; the former rules spent tens of seconds on each of the ':' ones.
PROMPTS = [
    ":" * 1023 + "x",
    "1" * 1023 + "x",
    "1-" * 511 + "a",
    "a." * 511 + "@",
    "mail bob@example.com " + "::" * 500 + "g",
]


def test_adversarial_prompts_do_not_stall_health_checks_and_are_recorded_redacted(bg, upstreams, tmp_path):
    upstreams.reset()
    db = tmp_path / "audit.db"
    key = mint_key()
    settings = gateway_settings(
        upstreams,
        tenants=[{"name": "acme", "audit_content": "redacted"}],
        api_keys=[{"id": key.id, "tenant": "acme", "sha256": key.sha256}],
        audit={"sqlite_path": str(db)},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    worst = 0.0
    stop = threading.Event()

    def probe() -> None:
        nonlocal worst
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert client.get(server.url + "/healthz").status_code == 200
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(0.01)

    def chat(text: str) -> httpx.Response:
        return httpx.post(
            server.url + "/v1/chat/completions",
            timeout=60,
            headers={"authorization": f"Bearer {key.key}"},
            json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": text}]},
        )

    try:
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            responses = list(pool.map(chat, PROMPTS))
        stop.set()
        prober.join(60)
        assert [r.status_code for r in responses] == [200] * len(PROMPTS), [r.text[:200] for r in responses]
        # Generous: a backtracking engine stalls for tens of seconds on these; RE2 takes microseconds.
        assert worst < 2.0, f"a health check waited {worst:.2f} s"
        conn = sqlite3.connect(db)
        try:
            kept = [
                orjson.loads(r[0])["payload"]["content"]["messages"][0]["text"]
                for r in conn.execute("SELECT data FROM audit_log WHERE kind = 'request' AND tenant = 'acme'")
            ]
        finally:
            conn.close()
        assert len(kept) == len(PROMPTS)
        assert any(t.startswith("mail [EMAIL] ") for t in kept) and not any(
            "bob@example.com" in t for t in kept
        )
    finally:
        stop.set()
        server.stop()
