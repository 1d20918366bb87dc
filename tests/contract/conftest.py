"""Fixtures the contract test modules share."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry

from policies.settings import PolicyChainConfig
from tests.conftest import gateway_settings
from tests.harness import GatewayServer


@pytest.fixture
def client(gateway):
    """The official openai SDK pointed at this module's ``gateway``, without retries of its own."""
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c


# -- the example config's policy chain (ops/config/omnigate.yaml) before the scripted engines ------------------
TEMPLATE = Path(__file__).resolve().parents[2] / "ops" / "config" / "omnigate.yaml"
#: the admin key of the example-chain gateways (their audit records are read through the admin API)
EXAMPLE_ADMIN_KEY = secrets.token_hex(32)


def example_chain(**grounding: Any) -> PolicyChainConfig:
    """The example config's chain as written, its grounding guard's config updated with ``grounding``."""
    chain = yaml.safe_load(TEMPLATE.read_text())["policies"]
    (post,) = [p for p in chain["post"] if p["name"] == "grounding"]
    post["config"] = {**post.get("config", {}), **grounding}
    return PolicyChainConfig.model_validate(chain)


@pytest.fixture(scope="module")
def example_chain_servers(bg, upstreams):
    """Gateways running the example chain (one per ``on_exhausted``), made when first asked for."""
    made: dict[str, GatewayServer] = {}

    def get(on_exhausted: str = "flag") -> GatewayServer:
        if on_exhausted not in made:
            chain = example_chain() if on_exhausted == "flag" else example_chain(on_exhausted=on_exhausted)
            settings = gateway_settings(
                upstreams, chain, admin={"api_key": EXAMPLE_ADMIN_KEY}, auth={"required": False}
            )
            made[on_exhausted] = GatewayServer(bg, settings, CollectorRegistry()).start()
        return made[on_exhausted]

    yield get
    for s in made.values():
        s.stop()


@pytest.fixture
def example_chain_gateway(example_chain_servers, upstreams):
    """``get(on_exhausted)``: an example-chain gateway with fresh scripted engines, and the SDK on it."""

    def get(on_exhausted: str = "flag") -> tuple[GatewayServer, openai.OpenAI]:
        upstreams.reset()
        server = example_chain_servers(on_exhausted)
        server.bg.run(server.services.pool.probe_now())
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return server, client

    return get
