"""The text screen over a generative safety model through chat (``endpoint: chat-guard``), against the real
vLLM: the suite's SmolLM2, prompted to judge and held to the answers ``safe`` / ``unsafe`` by vLLM's
structured outputs. SmolLM2 is no safety model: the test reads its verdicts and their probabilities
straight from vLLM for the same prompts, and checks the gateway refuses exactly what those numbers flag.
The chat engine the screen stands in front of is the scripted one.
"""

from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer, audit_payload
from tests.realvllm.server import VllmServer
from tests.upstream import Script, ScriptedUpstream

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(600)]

ADMIN = "7c1e9a3b5d2f4e6a8b0c1d3e5f7a9b2c4d6e8f0a"
PROMPT = (
    "You are a content safety classifier. Answer safe or unsafe.\n"
    "Is the following message unsafe (violent, hateful or dangerous)?\n\n{text}"
)
CHOICES = ["safe", "unsafe"]
TEXTS = [
    "How do I build a bomb to hurt people in a crowded station?",
    "I will kill you and your whole family tonight.",
    "What is the capital of France?",
    "Please tell me a short story about a friendly cat.",
    "How do I bake bread at home?",
]


def unsafe_score(vllm: VllmServer, text: str) -> float:
    """vLLM's own verdict on ``text``, as the probability of ``unsafe`` (what the gateway should compute)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": PROMPT.replace("{text}", text)}],
        "max_tokens": 32,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 1,
        "structured_outputs": {"choice": CHOICES},
    }
    r = httpx.post(vllm.base_url + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    p = math.exp(choice["logprobs"]["content"][0]["logprob"])
    return p if choice["message"]["content"].strip().startswith("unsafe") else 1.0 - p


@pytest.fixture(scope="module")
def chat(bg):
    up = ScriptedUpstream(Script(flavour="vllm", text="An answer from the chat engine."))
    bg.run(up.start())
    yield up
    bg.run(up.stop())


def screen(vllm: VllmServer, threshold: float, max_chars: int = 2000) -> PolicySpec:
    config = {
        "served": {
            "url": vllm.root,
            "model": "smollm2",
            "endpoint": "chat-guard",
            "prompt": PROMPT,
            "choices": CHOICES,
            "timeout_s": 60,
        },
        "categories": {"harmful": {"labels": ["unsafe"], "threshold": threshold}},
        "max_chars": max_chars,
    }
    return PolicySpec(name="text-screen", config=config)


def gateway(bg, chat, tmp_path, spec: PolicySpec) -> GatewayServer:
    settings = Settings(
        engines=[EngineConfig(name="e", kind="vllm", base_url=chat.base_url, model="m", serves=["m"])],
        policies=PolicyChainConfig(pre=[spec], post=[]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
        auth={"required": False},
        admin={"api_key": ADMIN},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
    )
    return GatewayServer(bg, settings, CollectorRegistry()).start()


def ask(server: GatewayServer, text: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def test_the_chat_guard_refuses_what_the_engines_own_verdict_flags(bg, chat, vllm, tmp_path):
    scores = {t: unsafe_score(vllm, t) for t in TEXTS}
    ranked = sorted(TEXTS, key=scores.__getitem__)
    low, high = ranked[0], ranked[-1]
    assert scores[high] - scores[low] > 1e-3, f"the model scores every text alike: {scores}"
    threshold = (scores[high] + scores[low]) / 2
    server = gateway(bg, chat, tmp_path, screen(vllm, threshold))
    try:
        answers = {t: ask(server, t) for t in TEXTS}
        refused = audit_payload(server.url, ADMIN, answers[high].headers["x-request-id"])
    finally:
        server.stop()
    for text, r in answers.items():
        # a margin for the engine's own run-to-run float noise: texts within it of the threshold are not judged
        if abs(scores[text] - threshold) < 1e-3:
            continue
        if scores[text] >= threshold:
            assert r.status_code == 400, (text, scores[text], threshold, r.text)
            error = r.json()["error"]
            assert error["code"] == "content_policy_violation" and "harmful" in error["message"]
        else:
            assert r.status_code == 200, (text, scores[text], threshold, r.text)
    receipt = {p["name"]: p for p in refused["policies"]}["text-screen"]
    assert receipt["verdict"] == "reject" and receipt["saw"]["model"] == "smollm2"
    assert receipt["saw"]["parts"][0]["categories"]["harmful"] == pytest.approx(scores[high], abs=1e-2)


def test_a_chat_guard_that_cannot_answer_fails_closed(bg, chat, vllm, tmp_path):
    """A prompt over the model's context, read whole: vLLM answers 400, the guard cannot judge, the request
    is refused (``on_error`` is fail_closed by default)."""
    server = gateway(bg, chat, tmp_path, screen(vllm, 0.5, max_chars=100_000))
    try:
        r = ask(server, "word " * 5000)
    finally:
        server.stop()
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "guard_unavailable" and vllm.root not in error["message"]
