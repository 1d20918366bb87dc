"""The text screen with its classifier unreachable: ``on_error`` decides, and the receipt says so.

The classifier's address is one where nothing listens (the real classifier's verdicts are tested against
the real vLLM in tests/realvllm/test_served_guards.py); the chat engine is the scripted one.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer, audit_payload, free_port
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

ADMIN = "0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b"


@pytest.fixture(scope="module")
def engine(bg):
    up = ScriptedUpstream(Script(flavour="vllm", text="A clean answer. It has two sentences."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


def _config() -> dict:
    return {
        "served": {
            "url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
            "model": "prompt-guard",
            "endpoint": "classify",
            "labels": ["benign", "injection"],
            "timeout_s": 1,
        },
        "categories": {"prompt_injection": {"labels": ["injection"], "threshold": 0.5}},
    }


def _gateway(bg, engine, tmp_path, stage: str, on_error: str) -> GatewayServer:
    name = "text-screen" if stage == "pre" else "text-screen-answers"
    spec = PolicySpec(name=name, on_error=on_error, config=_config())
    settings = Settings(
        engines=[EngineConfig(name="e", kind="vllm", base_url=engine.base_url, model="m", serves=["m"])],
        policies=PolicyChainConfig(**{stage: [spec]}),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("on_error", ["fail_closed", "fail_open"])
def test_an_unreachable_classifier_follows_on_error(bg, engine, tmp_path, stage, on_error, stream):
    name = "text-screen" if stage == "pre" else "text-screen-answers"
    server = _gateway(bg, engine, tmp_path, stage, on_error)
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]}
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        payload = audit_payload(server.url, ADMIN, r.headers["x-request-id"])
    finally:
        server.stop()
    receipt = {p["name"]: p for p in payload["policies"]}[name]
    if on_error == "fail_closed":
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "guard_unavailable" and name in error["message"]
        assert "127.0.0.1" not in error["message"]
        assert receipt["verdict"] == "unavailable"
    else:
        assert r.status_code == 200 and "sentences" in r.text  # the answer, whole or in pieces
        assert f"{name}=not_scanned" in r.headers["x-omnigate-guards"]
        assert receipt["verdict"] == "not_scanned"
    assert receipt["complete"] is False and receipt["saw"]["on_error"] == on_error
    assert receipt["saw"]["model"] == "prompt-guard"
