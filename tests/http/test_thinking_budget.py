"""The thinking budget (32k): sent to an engine that enforces it, refused or capped through max_tokens where not.

The plain vLLM engine here is declared ``thinking_budget: true`` (served with --reasoning-parser and
--reasoning-config, so vLLM enforces ``thinking_token_budget``); the vLLM-Omni engines are not, and the
INT4 one has a small ``max_thinking_tokens`` so that the max_tokens cap can be seen.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(bg, upstreams):
    settings = gateway_settings(upstreams)
    engines = {e.name: e for e in settings.engines}
    engines["text-vllm"].thinking_budget = True
    engines["omni-int4"].max_thinking_tokens = 1024
    s = GatewayServer(bg, settings, CollectorRegistry()).start()
    yield s
    s.stop()


@pytest.fixture
def fresh(upstreams, server):
    upstreams.reset()
    server.bg.run(server.services.pool.probe_now())
    return upstreams


def _chat(server, model: str = TEXT_MODEL, **body) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": "think about it"}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=10)


# -- an engine that enforces the budget --------------------------------------------------------------
def test_the_default_budget_is_sent_when_thinking_is_not_off(server, fresh):
    assert _chat(server).status_code == 200
    assert fresh.vllm.requests[-1]["thinking_token_budget"] == 32768
    assert _chat(server, chat_template_kwargs={"enable_thinking": True}).status_code == 200
    assert fresh.vllm.requests[-1]["thinking_token_budget"] == 32768


def test_a_smaller_budget_is_sent_as_asked(server, fresh):
    resp = _chat(server, thinking_token_budget=1000)
    assert resp.status_code == 200
    assert "x-omnigate-degraded" not in resp.headers
    assert fresh.vllm.requests[-1]["thinking_token_budget"] == 1000


def test_a_larger_budget_is_capped_at_32k_and_signalled(server, fresh):
    resp = _chat(server, thinking_token_budget=100_000)
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "thinking-budget-capped"
    assert fresh.vllm.requests[-1]["thinking_token_budget"] == 32768


def test_no_budget_when_thinking_is_off(server, fresh):
    assert _chat(server, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert "thinking_token_budget" not in fresh.vllm.requests[-1]


# -- engines that cannot enforce it ------------------------------------------------------------------
def test_a_budget_below_max_tokens_is_refused_where_no_engine_enforces_it(server, fresh):
    resp = _chat(
        server, OMNI_MODEL, thinking_token_budget=500, chat_template_kwargs={"enable_thinking": True}
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "thinking_token_budget"
    assert err["code"] == "thinking_budget_unsupported"
    assert "max_tokens" in err["message"]
    assert fresh.omni_a.request_count == 0 and fresh.omni_b.request_count == 0


def test_a_budget_max_tokens_already_bounds_is_served_without_the_field(server, fresh):
    resp = _chat(server, OMNI_MODEL, thinking_token_budget=500, max_tokens=400)
    assert resp.status_code == 200, resp.text
    sent = fresh.omni_a.requests[-1]
    assert "thinking_token_budget" not in sent
    assert sent["max_tokens"] == 400


def test_the_thinking_cap_is_enforced_through_max_tokens(server, fresh):
    # omni-int4 enforces no budget and allows 1024 thinking tokens: max_tokens is what bounds them.
    resp = _chat(server, OMNI_MODEL, max_tokens=4000)
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "thinking-budget-as-max-tokens"
    sent = fresh.omni_a.requests[-1]
    assert sent["max_tokens"] == 1024
    assert "thinking_token_budget" not in sent


def test_thinking_off_leaves_max_tokens_alone(server, fresh):
    resp = _chat(server, OMNI_MODEL, max_tokens=4000, chat_template_kwargs={"enable_thinking": False})
    assert resp.status_code == 200
    assert "x-omnigate-degraded" not in resp.headers
    assert fresh.omni_a.requests[-1]["max_tokens"] == 4000


def test_a_negative_budget_is_a_400(server, fresh):
    resp = _chat(server, thinking_token_budget=-5)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "thinking_token_budget"
