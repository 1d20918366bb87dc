"""Session fixtures of the real vLLM suite: one vLLM server (prepared on first use) and a gateway in front."""

from __future__ import annotations

import openai
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer
from tests.otlp import Receiver
from tests.realvllm.prepare import prepare
from tests.realvllm.server import VllmServer
from tests.upstream import Script, ScriptedUpstream

MODEL = "smollm2-chat"  # the gateway's public name
ENGINE = "real-vllm"


@pytest.fixture(scope="session")
def otlp(bg) -> Receiver:
    """The suite's trace collector: vLLM exports its spans here, and a traced gateway its own."""
    receiver = bg.run(Receiver().start())
    yield receiver
    bg.run(receiver.stop())


@pytest.fixture(scope="session")
def vllm(otlp) -> VllmServer:
    # Started once for the suite, exporting its own OpenTelemetry spans (tests/realvllm/test_traces.py).
    server = VllmServer(prepare(), otlp_traces_endpoint=otlp.url).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spare(bg) -> ScriptedUpstream:
    """A second engine for the same model (the failover target): the scripted vLLM."""
    up = ScriptedUpstream(Script(flavour="vllm", text="The spare engine answers."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


def real_settings(vllm: VllmServer, spare: ScriptedUpstream | None = None, **extra) -> Settings:
    engines = [
        EngineConfig(
            name=ENGINE,
            kind="vllm",
            base_url=vllm.base_url,
            model="smollm2",
            variant="bf16",
            serves=[MODEL],
            first_byte_timeout_s=120,
            read_timeout_s=120,
            max_context_tokens=2048,
        ),
    ]
    if spare is not None:
        engines.append(
            EngineConfig(
                name="spare",
                kind="vllm",
                base_url=spare.base_url,
                model="scripted",
                variant="bf16",
                role="fallback",
                serves=[MODEL],
                first_byte_timeout_s=5,
                read_timeout_s=5,
            )
        )
    return Settings(
        engines=engines,
        policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}, "signals": {"scrape_interval_s": 0.5}},
        **extra,
    )


@pytest.fixture(scope="session")
def real_gateway(bg, vllm, tmp_path_factory) -> GatewayServer:
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    server = GatewayServer(
        bg, real_settings(vllm, audit={"sqlite_path": str(db)}), CollectorRegistry()
    ).start()
    yield server
    server.stop()


@pytest.fixture
def via(real_gateway) -> openai.OpenAI:
    """The openai SDK through the gateway."""
    with openai.OpenAI(base_url=real_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=180) as c:
        yield c


@pytest.fixture
def direct(vllm) -> openai.OpenAI:
    """The openai SDK straight to vLLM: what the gateway's answers are compared with."""
    with openai.OpenAI(base_url=vllm.base_url, api_key="unused", max_retries=0, timeout=180) as c:
        yield c


@pytest.fixture(scope="session")
def cross_encoder_engine() -> VllmServer:
    """vLLM serving a tiny one-label cross-encoder (``--runner pooling``: /score, /rerank), once a session."""
    from tests.realvllm.guard_models import PoolingServer, cross_encoder

    server = PoolingServer(prepare(), cross_encoder(), "guard-nli").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def classifier_engine() -> VllmServer:
    """vLLM serving a tiny three-label classifier (``--runner pooling``: /classify), once a session."""
    from tests.realvllm.guard_models import PoolingServer, classifier

    server = PoolingServer(prepare(), classifier(), "guard-classifier").start()
    yield server
    server.stop()
