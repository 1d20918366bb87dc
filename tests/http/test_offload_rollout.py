"""VRAM offload end to end: a gateway's controller puts an idle engine on the pressured GPU to sleep through the
scripted vLLM-Omni's /v1/omni/sleep, and on the way back wakes it and routes to it only once its gauge says awake."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engines.rollout.rules import Rule, RuleAction, RuleSelector
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import chat, engines, settings

pytestmark = pytest.mark.timeout(120)


def _on_gpu(engine, gpu: str):
    return engine.model_copy(update={"telemetry": engine.telemetry.model_copy(update={"gpus": [gpu]})})


def test_vram_pressure_sleeps_the_idle_bf16_on_the_same_gpu_and_the_way_back_wakes_it_before_it_takes_traffic(
    bg, fresh
):
    int4, int8, bf16 = engines(fresh)
    engine_list = [_on_gpu(int4, "0"), _on_gpu(int8, "1"), _on_gpu(bf16, "0")]
    vram = Rule(
        name="vram-pressure",
        signal="vram_usage",
        above=0.9,
        for_s=0.3,
        min_samples=0,
        recover_below=0.8,
        recover_for_s=0.3,
        action=RuleAction(kind="limit_concurrency", concurrency_factor=0.5, sleep_idle=True),
    )
    # Once BF16 is awake again, a latency shift may send it traffic: this is the shift that waits for it.
    latency = Rule(
        name="int4-latency",
        select=RuleSelector(variants=["int4"]),
        signal="kv_cache_usage",  # a scraped signal the test can set at once
        above=0.97,
        for_s=0.3,
        min_samples=0,
        recover_below=0.1,
        recover_for_s=600,
        action=RuleAction(kind="shift", to_variants=["bf16"], trickle_weight=0.0),
    )
    server = GatewayServer(bg, settings(engine_list, [vram, latency]), CollectorRegistry()).start()
    pool, controller = server.services.pool, server.services.controller
    try:
        fresh.set(fresh.int4, kv_cache_usage_perc=0.95, num_requests_running=8)
        assert wait_until(lambda: bg.call(lambda: dict(fresh.bf16.sleeping_stages)) == {0: 1, 1: 1, 2: 1}, 30)
        assert bg.call(lambda: fresh.bf16.sleep_calls) == [("sleep", {"stage_ids": [0, 1, 2], "level": 1})]
        assert bg.call(lambda: fresh.int8.sleep_calls) == []  # another GPU: left alone
        assert bg.call(lambda: dict(pool.table.limits)) == {"omni-int4": 4}
        assert bg.call(lambda: pool.table.engine_weight("omni-bf16")) == 0.0
        kinds = [t.action for t in bg.call(lambda: list(controller.recent)) if t.source == "auto"]
        assert kinds[:2] == ["limit_concurrency", "sleep"]

        # The INT4 engine gets worse: the shift is due, but BF16 sleeps, so it is woken first; its gauge lags.
        fresh.set(fresh.bf16, wake_delay_s=3.0)
        fresh.set(fresh.int4, kv_cache_usage_perc=0.99)
        assert wait_until(
            lambda: ("wakeup", {"stage_ids": [0, 1, 2]}) in bg.call(lambda: fresh.bf16.sleep_calls), 30
        )
        bg.call(lambda: fresh.bf16.reset_stats())

        # While the gauge still reads asleep, BF16 takes nothing. Only the chats sent while it was still
        # waking count (on a loaded machine the wake may end before the third).
        def phase() -> str | None:
            return bg.call(lambda: getattr(controller.state.sleeping.get("omni-bf16"), "phase", None))

        sent_while_waking = 0
        for _ in range(3):
            if phase() != "waking":
                break
            assert chat(server.url).ok
            sent_while_waking += 1
        assert sent_while_waking >= 1
        assert bg.call(lambda: fresh.bf16.request_count) == 0
        assert wait_until(lambda: bg.call(lambda: pool.table.engine_weight("omni-bf16")) == 1.0, 30)
        recent = [t for t in bg.call(lambda: list(controller.recent)) if t.source == "auto"]
        order = [t.action for t in recent]
        assert order.index("wake") < order.index("awake") < order.index("shift")
        wake = next(t for t in recent if t.action == "wake")
        awake = next(t for t in recent if t.action == "awake")
        assert awake.at - wake.at >= 1.0  # it waited for the gauge, not for the wakeup's 200
        assert bg.call(lambda: dict(controller.state.sleeping)) == {}
        assert chat(server.url).ok and bg.call(lambda: fresh.bf16.request_count) >= 1
    finally:
        server.stop()

        def _awake() -> None:
            for u in fresh.all:
                u.sleeping_stages.clear()
                u.sleep_calls.clear()
                u.wake_delay_s = 0.0

        bg.call(_awake)
