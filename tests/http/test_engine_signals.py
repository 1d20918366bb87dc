"""The rollback rules read the engine's own latency, not the client's: over real sockets and scripted engines.

Each gateway (and, last, two replicas sharing the controller through Redis) carries the default ``int4-latency`` rule (its signal and action as
shipped, with a low threshold and short timers so a test is quick) and a control
rule on the client-visible TTFT. The control firing proves the load looked slow
to clients; the default rule then must not have moved INT4's traffic, because
nothing BF16 could fix was slow. A slow engine moves it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.rules import Rule, RuleAction, default_rules
from engines.rollout.settings import SharedStateSettings
from policies.base import PolicyBase, PolicyConfig
from policies.registry import available_plugins
from policies.settings import PolicyChainConfig, PolicySpec
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


FAST = {"above": 0.15, "for_s": 0.3, "min_samples": 5, "recover_below": 0.05, "recover_for_s": 600}


def _shipped(name: str, **over) -> Rule:
    """A shipped rule as it is (signal, selection, action), with a low threshold and short timers."""
    rule = next(r for r in default_rules() if r.name == name)
    action = (
        rule.action.model_copy(update={"trickle_weight": 0.0}) if rule.action.kind == "shift" else rule.action
    )
    return rule.model_copy(update={**FAST, "action": action, **over})


def _rules(control_signal: str = "ttft_p99") -> list[Rule]:
    control = Rule(name="client-ttft", signal=control_signal, **FAST,
                   action=RuleAction(kind="limit_concurrency", min_concurrency=4))  # fmt: skip
    return [_shipped("int4-latency"), control]


def _start(
    bg,
    trio: Trio,
    pre_delay_s: float = 0.0,
    state: SharedStateSettings | None = None,
    rules: list[Rule] | None = None,
    **engine_over,
) -> GatewayServer:
    configs = [e.model_copy(update=engine_over) if e.variant == "int4" else e for e in engines(trio)]
    s = settings(configs, rules or _rules(), state=state)
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
    # Each whole answer takes ~0.3 s to generate: a client waits that long for the whole answer.
    fresh.set(fresh.int4, default=Script(flavour="omni", chunk_delay_s=0.03))
    server = _start(bg, fresh, rules=_rules("e2e_p99"))
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
        # Nor is its whole duration a time to first token: it is the request's duration, not streamed.
        assert not sample("omnigate_time_to_first_token_seconds_count", labels)
        served = {**labels, "outcome": "served", "stream": "false"}
        assert sample("omnigate_request_duration_seconds_count", served) > 0
        assert (
            sample("omnigate_request_duration_seconds_sum", served)
            / sample("omnigate_request_duration_seconds_count", served)
            >= 0.25
        )
        signals = server.bg.call(lambda: server.services.pool.summaries()["omni-int4"].values()[1])
        assert signals["ttft_p50"] == 0 and signals["e2e_p50"] > 0
    finally:
        server.stop()


# -- the batch limit: raised for an engine whose first tokens come late, never past what it runs at once ----


def _batch_rules() -> list[Rule]:
    return [_shipped("latency-batch", recover_below=0.01)]


def _cap(server: GatewayServer) -> int | None:
    return server.bg.call(lambda: server.services.pool.limit("omni-int4"))


def test_sequential_non_streamed_requests_to_an_idle_engine_raise_no_cap(bg, fresh):
    # Whole answers of ~0.5 s each, one at a time: an idle engine, however long its answers take.
    fresh.set(fresh.int4, default=Script(flavour="omni", chunk_delay_s=0.05))
    control = Rule(name="client-e2e", signal="e2e_p50", **FAST,
                   action=RuleAction(kind="limit_concurrency", min_concurrency=8))  # fmt: skip
    server = _start(bg, fresh, rules=[*_batch_rules(), control], max_in_flight=8, max_num_seqs=16)
    try:
        assert wait_until(
            lambda: _complete(server.url) and "client-e2e" in _fired(server), timeout=90, interval=0
        )
        assert all(_complete(server.url) for _ in range(3))
        assert "latency-batch" not in _fired(server)
        assert _cap(server) == 8
    finally:
        server.stop()


def test_an_engine_slow_to_its_first_token_raises_the_cap_up_to_its_max_num_seqs(bg, fresh):
    fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
    # Twice the cap (8) would pass what the engine runs at once (6).
    server = _start(bg, fresh, rules=_batch_rules(), max_in_flight=4, max_num_seqs=6)
    try:
        assert _cap(server) == 4
        assert wait_until(
            lambda: chat(server.url).ok and "latency-batch" in _fired(server), timeout=90, interval=0
        )
        assert wait_until(lambda: _cap(server) == 6, timeout=30)
    finally:
        server.stop()


def test_an_engine_that_declares_no_max_num_seqs_is_never_raised(bg, fresh):
    fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
    control = Rule(name="engine-ttft", signal="upstream_ttft_p50", **FAST,
                   action=RuleAction(kind="limit_concurrency", min_concurrency=8))  # fmt: skip
    server = _start(bg, fresh, rules=[*_batch_rules(), control], max_in_flight=4)
    try:
        assert wait_until(
            lambda: chat(server.url).ok and "engine-ttft" in _fired(server), timeout=90, interval=0
        )
        assert all(chat(server.url).ok for _ in range(3))
        assert "latency-batch" not in _fired(server) and _cap(server) == 4
    finally:
        server.stop()


# -- whole answers feed the rollback through the engine's time per output token ---------------------------

_LONG = " ".join(f"word{i}" for i in range(20))  # 20 output tokens: a whole answer long enough to count


def _complete_many(url: str, n: int = 5) -> bool:
    with ThreadPoolExecutor(n) as pool:
        return all(pool.map(lambda _: _complete(url), range(n)))


def test_a_slow_engine_under_non_streamed_load_rolls_int4_back(bg, fresh):
    # 20 tokens at 60 ms each: 1.2 s an answer, 60 ms per output token (over the test's 30 ms).
    fresh.set(fresh.int4, default=Script(flavour="omni", text=_LONG, chunk_delay_s=0.06))
    rules = [_shipped("int4-latency"), _shipped("int4-latency-whole", above=0.03, recover_below=0.001)]
    server = _start(bg, fresh, rules=rules)
    try:
        assert wait_until(
            lambda: _complete_many(server.url) and "int4-latency-whole" in _fired(server), timeout=90,
            interval=0,
        )  # fmt: skip
        assert "int4-latency" not in _fired(server)  # no streamed answer, no first token
        before = fresh.counts()
        assert all(_complete(server.url) for _ in range(3))
        after = fresh.counts()
        assert after["int4"] == before["int4"] and after["bf16"] - before["bf16"] == 3
    finally:
        server.stop()


def test_a_fast_engine_under_non_streamed_load_is_not_rolled_back(bg, fresh):
    # 20 tokens at 2 ms each: the engine's answers take 40 ms and more, a few ms per output token.
    fresh.set(fresh.int4, default=Script(flavour="omni", text=_LONG, chunk_delay_s=0.002))
    control = Rule(name="engine-e2e", signal="upstream_e2e_p50", **{**FAST, "above": 0.02, "recover_below": 0.01},
                   action=RuleAction(kind="limit_concurrency", min_concurrency=8))  # fmt: skip
    rules = [_shipped("int4-latency-whole", above=0.03, recover_below=0.001), control]
    server = _start(bg, fresh, rules=rules)
    try:
        assert wait_until(
            lambda: _complete_many(server.url) and "engine-e2e" in _fired(server), timeout=90, interval=0
        )
        assert "int4-latency-whole" not in _fired(server)
        assert fresh.counts()["bf16"] == 0
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
        # What the rollback rules (and the alerts on them) read: per 1,000 prompt tokens, and a prompt
        # under the floor (the scripted engine reports 11 tokens) counts as 1,000: its TTFT.
        per_1k = {**labels, "model": MODEL}
        name = "omnigate_engine_time_to_first_token_per_1k_prompt_tokens_seconds"
        assert sample(f"{name}_count", per_1k) == engine_n
        assert sample(f"{name}_sum", per_1k) == pytest.approx(engine_sum)
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

    def both() -> bool:
        # One request to each replica at once: a request takes 0.6 s here, and one at a time would leave
        # the 3 s window right at the rules' five samples.
        with ThreadPoolExecutor(2) as pool:
            return all(a.ok for a in pool.map(lambda s: chat(s.url), servers))

    try:
        assert wait_until(lambda: both() and "client-ttft" in fired(), timeout=90, interval=0)
        assert "int4-latency" not in fired()

        fresh.set(fresh.int4, default=Script(flavour="omni", first_byte_delay_s=0.3))
        assert wait_until(lambda: both() and "int4-latency" in fired(), timeout=90, interval=0)
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
