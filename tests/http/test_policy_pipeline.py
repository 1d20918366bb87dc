"""The policy pipeline end to end: order as data, shadow mode, stream filters, retries, registry checks."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from policies.registry import PolicyConfigError, available_plugins, build_chain
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import OMNI_MODEL, TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.plugins import PLUGINS
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

ALL_PLUGINS = {**available_plugins(), **PLUGINS}


def _serve(bg, upstreams, chain: PolicyChainConfig) -> GatewayServer:
    settings = gateway_settings(upstreams, chain)
    return GatewayServer(bg, settings, CollectorRegistry(), plugins=ALL_PLUGINS).start()


@pytest.fixture
def serve(bg, upstreams):
    servers: list[GatewayServer] = []

    def _make(**stages) -> GatewayServer:
        upstreams.reset()
        server = _serve(bg, upstreams, PolicyChainConfig(**stages))
        servers.append(server)
        return server

    yield _make
    for s in servers:
        s.stop()


def _chat(server: GatewayServer, **body) -> httpx.Response:
    payload = {"model": TEXT_MODEL, "messages": [{"role": "user", "content": "hello"}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=10)


def test_pre_policies_run_in_configured_order(serve, upstreams):
    server = serve(
        pre=[
            PolicySpec(name="append-tag", config={"tag": "a"}),
            PolicySpec(name="append-tag", config={"tag": "b"}),
        ]
    )
    assert _chat(server).status_code == 200
    assert upstreams.vllm.requests[-1]["messages"][-1]["content"] == "hello[a][b]"


def test_reversed_config_reverses_order(serve, upstreams):
    server = serve(
        pre=[
            PolicySpec(name="append-tag", config={"tag": "b"}),
            PolicySpec(name="append-tag", config={"tag": "a"}),
        ]
    )
    assert _chat(server).status_code == 200
    assert upstreams.vllm.requests[-1]["messages"][-1]["content"] == "hello[b][a]"


def test_reject_is_an_openai_error_and_shadow_only_records(serve, upstreams):
    acting = serve(pre=[PolicySpec(name="always-reject")])
    resp = _chat(acting)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "content_policy_violation"
    assert upstreams.vllm.request_count == 0

    shadow = serve(pre=[PolicySpec(name="always-reject", shadow=True)])
    assert _chat(shadow).status_code == 200
    metrics = httpx.get(shadow.url + "/metrics").text
    assert (
        'omnigate_policy_decisions_total{policy="always-reject",shadow="true",stage="pre",verdict="reject"} 1.0'
        in metrics
    )


def test_stream_filter_transforms_released_chunks(serve, upstreams):
    server = serve(stream=[PolicySpec(name="uppercase")])
    upstreams.vllm.default = Script(flavour="vllm", text="quiet words here")
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=10,
        json={"model": TEXT_MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
    ) as r:
        body = r.read().decode()
    assert '"QUIET "' in body and "quiet" not in body


def test_post_retry_non_streaming(serve, upstreams):
    server = serve(post=[PolicySpec(name="retry-unless-cold")])
    upstreams.vllm.enqueue(Script(flavour="vllm", text="first"), Script(flavour="vllm", text="second"))
    resp = _chat(server, temperature=0.9)
    assert resp.json()["choices"][0]["message"]["content"] == "second"
    assert [r.get("temperature") for r in upstreams.vllm.requests] == [0.9, 0.0]
    assert 'omnigate_retries_total{policy="retry-unless-cold"} 1.0' in httpx.get(server.url + "/metrics").text


def test_post_retry_streaming_while_held_releases_only_the_accepted_answer(serve, upstreams):
    server = serve(stream=[PolicySpec(name="hold-all")], post=[PolicySpec(name="retry-unless-cold")])
    upstreams.omni_a.enqueue(
        Script(flavour="omni", text="rejected draft"), Script(flavour="omni", text="kept")
    )
    payload = {
        "model": OMNI_MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "temperature": 0.7,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=10) as r:
        body = r.read().decode()
    assert "kept" in body and "rejected" not in body
    assert upstreams.omni_a.request_count == 2
    assert body.rstrip().endswith("data: [DONE]")


def test_retry_budget_is_bounded(serve, upstreams):
    # The post-policy always wants a retry at temperature>0; with budget 0 it is served, flagged.
    server = serve(post=[PolicySpec(name="retry-unless-cold")], max_retries=0)
    resp = _chat(server, temperature=0.5)
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "retries-exhausted"
    assert upstreams.vllm.request_count == 1


def test_registry_checks_plugins_when_loading():
    with pytest.raises(PolicyConfigError, match=r"policies.pre\[0\].name: unknown policy 'nope'"):
        build_chain(PolicyChainConfig(pre=[PolicySpec(name="nope")]), ALL_PLUGINS)
    with pytest.raises(PolicyConfigError, match="is a post policy, not pre"):
        build_chain(PolicyChainConfig(pre=[PolicySpec(name="retry-unless-cold")]), ALL_PLUGINS)
    with pytest.raises(PolicyConfigError, match="does not implement the pre hook"):
        build_chain(PolicyChainConfig(pre=[PolicySpec(name="no-hook")]), ALL_PLUGINS)
    with pytest.raises(PolicyConfigError, match=r"policies.pre\[0\].config.max_messages"):
        build_chain(
            PolicyChainConfig(pre=[PolicySpec(name="request-limits", config={"max_messages": 0})]),
            ALL_PLUGINS,
        )
    with pytest.raises(PolicyConfigError, match=r"config.unknown_knob"):
        build_chain(
            PolicyChainConfig(pre=[PolicySpec(name="request-limits", config={"unknown_knob": 1})]),
            ALL_PLUGINS,
        )


def test_builtin_policies_register_through_the_entry_point_group():
    assert "request-limits" in available_plugins()
