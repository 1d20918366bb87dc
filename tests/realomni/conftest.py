"""Session fixtures of the real vLLM-Omni suite: one vLLM-Omni server (prepared on first use), a gateway in front."""

from __future__ import annotations

import os

import openai
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer
from tests.realomni.prepare import prepare
from tests.realomni.server import OmniServer

MODEL = "omni-chat"  # the gateway's public name: the engine with its voices listed
UNCHECKED = "omni-unchecked"  # the same engine, its voices not configured: the engine judges the voice
ENGINE = "real-omni"
VOICES = ["Aiden", "Chelsie", "Ethan"]  # the tiny model's talker_config.speaker_id (build_model.py)


@pytest.fixture(scope="session")
def omni() -> OmniServer:
    server = OmniServer(prepare())
    running = os.environ.get("OMNIGATE_REAL_OMNI_PORT")
    if (
        running
    ):  # a server already started with prepare.server_command (working on the suite): used, not stopped
        server.port = int(running)
        server.wait_ready()
        yield server
        return
    yield server.start()
    server.stop()


def omni_settings(omni: OmniServer, pre: list[PolicySpec] | None = None, **extra) -> Settings:
    common = dict(kind="vllm-omni", base_url=omni.base_url, model=omni.served_name, variant="bf16",
                  first_byte_timeout_s=300, read_timeout_s=300, max_context_tokens=2048)  # fmt: skip
    return Settings(
        engines=[
            EngineConfig(name=ENGINE, serves=[MODEL], voices=VOICES, **common),
            EngineConfig(name="real-omni-unchecked", serves=[UNCHECKED], **common),
        ],
        # An output budget the tiny stages can afford (the default, 8192, is beyond their 2048 context).
        policies=PolicyChainConfig(
            pre=[*(pre or []), PolicySpec(name="request-limits", config={"max_output_tokens": 64})]
        ),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}, "signals": {"scrape_interval_s": 0.5}},
        **extra,
    )


@pytest.fixture(scope="session")
def omni_gateway(bg, omni, tmp_path_factory) -> GatewayServer:
    db = tmp_path_factory.mktemp("omni-audit") / "audit.db"
    server = GatewayServer(
        bg, omni_settings(omni, audit={"sqlite_path": str(db)}), CollectorRegistry()
    ).start()
    server.db = db
    yield server
    server.stop()


@pytest.fixture
def via(omni_gateway) -> openai.OpenAI:
    """The openai SDK through the gateway."""
    with openai.OpenAI(base_url=omni_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture
def direct(omni) -> openai.OpenAI:
    """The openai SDK straight to vLLM-Omni."""
    with openai.OpenAI(base_url=omni.base_url, api_key="unused", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def shedding_gateway(bg, omni) -> GatewayServer:
    """A gateway whose admission is always above its soft limit (0), with load shedding first in its chain."""
    settings = omni_settings(
        omni, pre=[PolicySpec(name="load-shedding")], traffic={"soft_limit": 0, "hard_limit": 8}
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield server
    server.stop()
