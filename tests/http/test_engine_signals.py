"""The rollback rules read the engine's own latency, not the client's: over real sockets and scripted engines.

Each gateway (and, last, two replicas sharing the controller through Redis) carries the default ``int4-latency`` rule (its signal and action as
shipped, with a low threshold and short timers so a test is quick) and a control
rule on the client-visible TTFT. The control firing proves the load looked slow
to clients; the default rule then must not have moved INT4's traffic, because
nothing BF16 could fix was slow. A slow engine moves it.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import httpx
import pytest
from prometheus_client import CollectorRegistry

from core.control_settings import Rule, RuleAction, SharedStateSettings, default_rules
from core.settings import PolicyChainConfig, PolicySpec
from policies.base import PolicyBase, PolicyConfig
from policies.registry import available_plugins
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import MODEL, Trio, chat, engines, settings
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)


class SlowConfig(PolicyConfig):
    delay_s: float


class SlowPre(PolicyBase):
    """Pre: takes ``delay_s`` before the engine is called, as a media fetch or a video decode does."""

    name: ClassVar[str] = "slow-pre"
    stage: ClassVar[str] = "pre"
    Config = SlowConfig

    def __init__(self, config: SlowConfig) -> None:
        self.delay_s = config.delay_s

    async def pre(self, request, ctx):
        await asyncio.sleep(self.delay_s)
        return request


def _rules() -> list[Rule]:
    shipped = next(r for r in default_rules() if r.name == "int4-latency")
    fast = {"above": 0.15, "for_s": 0.3, "min_samples": 5, "recover_below": 0.05, "recover_for_s": 600}
    int4 = shipped.model_copy(
        update={**fast, "action": shipped.action.model_copy(update={"trickle_weight": 0.0})}
    )
    control = Rule(name="client-ttft", signal="ttft_p99", **fast,
                   action=RuleAction(kind="limit_concurrency", min_concurrency=4))  # fmt: skip
    return [int4, control]


def _start(
    bg, trio: Trio, pre_delay_s: float = 0.0, state: SharedStateSettings | None = None
) -> GatewayServer:
    s = settings(engines(trio), _rules(), state=state)
    if pre_delay_s:
        s = s.model_copy(update={"policies": PolicyChainConfig(
            pre=[PolicySpec(name="slow-pre", config={"delay_s": pre_delay_s})], stream=[], post=[])})  # fmt: skip
    return GatewayServer(
        bg, s, CollectorRegistry(), plugins={**available_plugins(), "slow-pre": SlowPre}
    ).start()


def _fired(server: GatewayServer) -> set[str]:
    return {t.reason for t in server.bg.call(lambda: list(server.services.controller.recent))}


def _complete(url: str) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_the_shipped_latency_rules_read_the_engines_time_to_first_token():
    rules = {r.name: r for r in default_rules()}
    assert rules["int4-latency"].signal == "upstream_ttft_per_1k_prompt_tokens_p99"
    assert rules["canary-latency"].signal == "upstream_ttft_per_1k_prompt_tokens_p99"


def test_non_streamed_load_does_not_roll_int4_back(bg, fresh):
    # Each whole answer takes ~0.3 s to generate: a client waits that long for its first token.
    fresh.set(fresh.int4, default=Script(flavour="omni", chunk_delay_s=0.03))
    server = _start(bg, fresh)
    try:
        assert wait_until(
            lambda: _complete(server.url) and "client-ttft" in _fired(server), timeout=90, interval=0
        )
        assert "int4-latency" not in _fired(server)
        assert fresh.counts()["int4"] > 0 and fresh.counts()["bf16"] == 0
        sample = server.registry.get_sample_value
        labels = {"engine": "omni-int4", "variant": "int4"}
        # The engine's latency is recorded as its own signal; a non-streamed answer has no first token to time.
        assert sample("omnigate_engine_request_seconds_count", {**labels, "stream": "false"}) > 0
        assert not sample("omnigate_engine_time_to_first_token_seconds_count", labels)
    finally:
        server.stop()


def test_a_slow_pre_policy_does_not_roll_int4_back(bg, fresh):
    server = _start(bg, fresh, pre_delay_s=0.3)
    try:
        assert wait_until(
            lambda: chat(server.url).ok and "client-ttft" in _fired(server), timeout=90, interval=0
        )
        assert "int4-latency" not in _fired(server)
        sample = server.registry.get_sample_value
        labels = {"engine": "omni-int4", "variant": "int4"}
        engine_sum = sample("omnigate_engine_time_to_first_token_seconds_sum", labels)
        engine_n = sample("omnigate_engine_time_to_first_token_seconds_count", labels)
        client_sum = sample("omnigate_time_to_first_token_seconds_sum", labels)
        client_n = sample("omnigate_time_to_first_token_seconds_count", labels)
        assert engine_n == client_n > 0
        assert client_sum / client_n >= 0.3 > engine_sum / engine_n  # the client waited for the pre-policy
    finally:
        server.stop()


def test_a_slow_engine_rolls_int4_back(bg, fresh):
    fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
    server = _start(bg, fresh)
    try:
        assert wait_until(
            lambda: chat(server.url).ok and "int4-latency" in _fired(server), timeout=90, interval=0
        )
        before = fresh.counts()
        assert all(chat(server.url).ok for _ in range(5))
        after = fresh.counts()
        assert after["int4"] == before["int4"] and after["bf16"] - before["bf16"] == 5
    finally:
        server.stop()


def test_two_replicas_on_redis_roll_back_for_a_slow_engine_not_for_a_slow_pre_policy(bg, fresh, prefix):
    def state(name: str) -> SharedStateSettings:
        return SharedStateSettings(backend="redis", key_prefix=prefix, lease_ttl_s=1.0,
                                   replica_id=name)  # fmt: skip

    a = _start(bg, fresh, pre_delay_s=0.3, state=state("replica-a"))
    b = _start(bg, fresh, pre_delay_s=0.3, state=state("replica-b"))
    servers = (a, b)

    def fired() -> set[str]:
        return _fired(a) | _fired(b)

    try:
        turn = iter(range(10**6))
        assert wait_until(lambda: chat(servers[next(turn) % 2].url).ok and "client-ttft" in fired(),
                          timeout=90, interval=0)  # fmt: skip
        assert "int4-latency" not in fired()

        fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
        assert wait_until(lambda: chat(servers[next(turn) % 2].url).ok and "int4-latency" in fired(),
                          timeout=90, interval=0)  # fmt: skip
        # The leader published the shift; the follower reads the shared table on its next tick.
        assert wait_until(lambda: all(
            s.bg.call(lambda s=s: s.services.pool.table.engine_weight("omni-int4")) == 0 for s in servers),
            timeout=30)  # fmt: skip
        before = fresh.counts()
        assert all(chat(s.url).ok for s in servers for _ in range(3))
        after = fresh.counts()
        assert (
            after["int4"] == before["int4"] and after["bf16"] - before["bf16"] == 6
        )  # both follow the table
    finally:
        a.stop()
        b.stop()
