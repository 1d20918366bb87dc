"""An engine serving another model id or revision than configured is never routed to; the right one is.

Two scripted vLLM engines for one public model, each configured with ``expected_model`` and
``expected_revision``; what each lists on ``/v1/models`` is changed under the running gateway and
the next health probe decides.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(60)

MODEL = "pinned"
REV = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
ADMIN = {"authorization": "Bearer 5f1e0c9a7b3d2e8f4a6c1b9d0e7f3a2c5b8d4e1f"}


def _serve(up: ScriptedUpstream, model: str, revision: str) -> None:
    up.models = [model]
    up.roots = {model: f"/models/hub/models--org--pinned/snapshots/{revision}"}


@pytest.fixture(scope="module")
def engines(bg):
    a = ScriptedUpstream(Script(flavour="vllm", text="from a"))
    b = ScriptedUpstream(Script(flavour="vllm", text="from b"))
    for u in (a, b):
        bg.run(u.start())
        _serve(u, "org/pinned", REV)
    yield a, b
    for u in (a, b):
        bg.run(u.stop())


@pytest.fixture(scope="module")
def server(bg, engines):
    a, b = engines
    settings = Settings(
        engines=[
            EngineConfig(
                name=name,
                kind="vllm",
                base_url=up.base_url,
                model="org/pinned",
                serves=[MODEL],
                role=role,
                expected_model="org/pinned",
                expected_revision=REV,
                first_byte_timeout_s=5,
                read_timeout_s=5,
            )
            for name, up, role in (("a", a, "primary"), ("b", b, "fallback"))
        ],
        policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        admin={"api_key": ADMIN["authorization"].removeprefix("Bearer ")},
        auth={"required": False},
    )
    registry = CollectorRegistry()
    s = GatewayServer(bg, settings, registry).start()
    s.registry = registry  # type: ignore[attr-defined]
    yield s
    s.stop()


@pytest.fixture
def fresh(bg, engines, server):
    for up in engines:
        _serve(up, "org/pinned", REV)
        up.models_status = 200
        bg.call(up.reset_stats)
    bg.run(server.services.pool.probe_now())
    return engines


def _ask(server) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        timeout=10,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )


def _probe(server) -> None:
    server.bg.run(server.services.pool.probe_now())


def _verified(server, engine: str) -> float | None:
    return server.registry.get_sample_value(
        "omnigate_engine_model_verified", {"engine": engine, "variant": "bf16"}
    )


def test_the_engines_serving_what_they_were_configured_with_are_routed_to(server, fresh):
    # fresh: both engines serve the pinned model and revision, and were probed
    resp = _ask(server)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == "from a"
    ready = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5).json()
    assert ready["engines"] == {"a": True, "b": True}
    assert ready["engine_problems"] == {}
    assert _verified(server, "a") == 1.0 and _verified(server, "b") == 1.0


def test_a_wrong_revision_is_never_routed_to(server, fresh):
    a, _b = fresh
    _serve(a, "org/pinned", OTHER)
    _probe(server)
    for _ in range(3):
        resp = _ask(server)
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["message"]["content"] == "from b"
    assert a.request_count == 0
    ready = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5).json()
    assert ready["engines"]["a"] is False
    assert "not the configured revision" in ready["engine_problems"]["a"]
    assert OTHER in ready["engine_problems"]["a"]
    assert (
        _verified(server, "a") == 0.0 and _verified(server, "b") == 1.0
    )  # what OmnigateEngineModelMismatch reads


def test_a_wrong_model_id_is_never_routed_to_even_as_a_last_resort(server, fresh):
    a, b = fresh
    _serve(a, "org/another-model", REV)
    _serve(b, "org/pinned", OTHER)
    _probe(server)
    resp = _ask(server)
    # Neither engine serves the configured weights: refused, never answered by the wrong ones.
    assert resp.status_code == 503
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert a.request_count == 0 and b.request_count == 0
    ready = httpx.get(server.url + "/readyz", headers=ADMIN, timeout=5)
    assert ready.status_code == 503
    problems = ready.json()["engine_problems"]
    assert "not the configured model 'org/pinned'" in problems["a"] and "org/another-model" in problems["a"]


def test_an_engine_back_on_the_right_revision_is_routed_to_again(server, fresh):
    a, _ = fresh
    _serve(a, "org/pinned", OTHER)
    _probe(server)
    assert _ask(server).json()["choices"][0]["message"]["content"] == "from b"
    _serve(a, "org/pinned", REV)
    _probe(server)
    assert _ask(server).json()["choices"][0]["message"]["content"] == "from a"
    assert server.services.pool.mismatches() == {}


def test_an_engine_whose_model_list_cannot_be_read_is_not_routed_to(server, fresh):
    a, _ = fresh
    a.models_status = 500  # /health still answers 200
    _probe(server)
    assert _ask(server).json()["choices"][0]["message"]["content"] == "from b"
    assert a.request_count == 0
    assert "could not be read" in server.services.pool.mismatches()["a"]
