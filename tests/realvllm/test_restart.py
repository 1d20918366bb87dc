"""vLLM killed and restarted under a running gateway: readiness follows it and requests fail over to the
second engine meanwhile. Runs last in the suite (it restarts the session's server)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.harness import GatewayServer
from tests.realvllm.conftest import ENGINE, MODEL, real_settings

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(1800)]

SPARE_TEXT = "The spare engine answers."


def _ask(gw: GatewayServer) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )


def test_vllm_killed_and_restarted(bg, vllm, spare, tmp_path):
    pair = GatewayServer(
        bg, real_settings(vllm, spare, audit={"sqlite_path": str(tmp_path / "a.db")}), CollectorRegistry()
    ).start()
    alone = GatewayServer(
        bg, real_settings(vllm, audit={"sqlite_path": str(tmp_path / "b.db")}), CollectorRegistry()
    ).start()
    try:
        first = _ask(pair)
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] != SPARE_TEXT
        assert httpx.get(alone.url + "/readyz", timeout=10).status_code == 200

        vllm.kill()
        failed_over = _ask(pair)
        assert failed_over.status_code == 200
        assert failed_over.json()["choices"][0]["message"]["content"] == SPARE_TEXT
        for gw in (pair, alone):
            bg.run(gw.services.pool.probe_now())
        assert not pair.services.pool.is_healthy(ENGINE) and pair.services.pool.is_healthy("spare")
        assert httpx.get(alone.url + "/readyz", timeout=10).status_code == 503
        down = _ask(alone)
        assert down.status_code == 503 and ENGINE not in down.text

        vllm.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for gw in (pair, alone):
                bg.run(gw.services.pool.probe_now())
            if httpx.get(alone.url + "/readyz", timeout=10).status_code == 200:
                break
            time.sleep(1)
        assert httpx.get(alone.url + "/readyz", timeout=10).status_code == 200
        assert pair.services.pool.is_healthy(ENGINE)
        # Back on vLLM once its circuit lets a trial through (half-open after its cool-down).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            again = _ask(pair)
            if again.status_code == 200 and again.json()["choices"][0]["message"]["content"] != SPARE_TEXT:
                break
            time.sleep(1)
        assert again.json()["choices"][0]["message"]["content"] != SPARE_TEXT
        assert _ask(alone).status_code == 200
    finally:
        pair.stop()
        alone.stop()
