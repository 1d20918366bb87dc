"""vLLM gone and back under running gateways: readiness follows it and requests fail over to the second engine
meanwhile.

The gateways reach the suite's one vLLM through a TCP proxy (tests/tcpproxy.py). Stopping the proxy leaves
what a killed vLLM leaves on the wire: new connections refused, open ones reset; starting it again on the same
port is vLLM back. What the test promises is the gateway's side (probes, readiness, failover, the circuit
letting vLLM back in), which sees the same bytes either way; the suite no longer pays a second boot of vLLM
(about 2.5 minutes on two cores) for it, and the test can run anywhere in the suite's order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.harness import GatewayServer
from tests.realvllm.conftest import ENGINE, MODEL, real_settings
from tests.tcpproxy import TCPProxy

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(1800)]

SPARE_TEXT = "The spare engine answers."


@dataclass(frozen=True)
class _Route:
    """vLLM as the gateways see it: its OpenAI API behind the proxy."""

    base_url: str


def _ask(gw: GatewayServer) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )


def test_vllm_gone_and_back(bg, vllm, spare, tmp_path):
    proxy = TCPProxy("127.0.0.1", vllm.port)
    bg.run(proxy.start())
    route = _Route(f"http://127.0.0.1:{proxy.port}/v1")
    pair = GatewayServer(
        bg, real_settings(route, spare, audit={"sqlite_path": str(tmp_path / "a.db")}), CollectorRegistry()
    ).start()
    alone = GatewayServer(
        bg, real_settings(route, audit={"sqlite_path": str(tmp_path / "b.db")}), CollectorRegistry()
    ).start()
    try:
        first = _ask(pair)
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] != SPARE_TEXT
        assert httpx.get(alone.url + "/readyz", timeout=10).status_code == 200

        bg.run(proxy.stop())  # vLLM's port dead: connections refused, the pooled ones reset
        failed_over = _ask(pair)
        assert failed_over.status_code == 200
        assert failed_over.json()["choices"][0]["message"]["content"] == SPARE_TEXT
        for gw in (pair, alone):
            bg.run(gw.services.pool.probe_now())
        assert not pair.services.pool.is_healthy(ENGINE) and pair.services.pool.is_healthy("spare")
        assert httpx.get(alone.url + "/readyz", timeout=10).status_code == 503
        down = _ask(alone)
        assert down.status_code == 503 and ENGINE not in down.text

        bg.run(proxy.start())  # vLLM back on the same address
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
        bg.run(proxy.stop())
