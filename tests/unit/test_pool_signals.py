"""Circuit breaker, weighted choice, latency windows and telemetry parsing: the pool's parts without HTTP."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from engines.rollout.routing import EngineInfo, RoutingTable, base_weights
from engines.rollout.settings import CircuitSettings, RoutingSettings
from engines.rollout.signals import EngineSummary, OutcomeWindow, bucket_counts, quantile
from engines.rollout.telemetry import bucket_delta, histogram_quantile, parse_dcgm, parse_vllm
from engines.selection.circuit import Circuit
from engines.selection.pool import EnginePool, build_engine
from observability.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- circuit -------------------------------------------------------------------------------------------


def test_circuit_ejects_after_consecutive_failures_then_lets_one_trial_through():
    clock = Clock()
    c = Circuit(CircuitSettings(consecutive_failures=3, base_ejection_s=10, max_ejection_s=25), clock)
    assert [c.failure(), c.failure()] == [None, None]
    c.success()  # a success in between resets the run
    assert [c.failure(), c.failure(), c.failure()] == [None, None, "open"]
    assert c.admit() == (False, None) and not c.available()
    clock.t += 10
    assert c.current() == "half_open" and c.available()
    assert c.admit() == (True, "half_open")
    assert c.admit() == (False, None)  # one trial at a time
    assert c.failure() == "open"  # the trial failed: ejected again, for longer
    assert c.open_until == pytest.approx(clock.t + 20)
    clock.t += 20
    assert c.admit() == (True, "half_open")
    c.release()  # the trial ended without an outcome: the slot is free again
    assert c.admit() == (True, None)
    assert c.success() == "closed" and c.available()
    for _ in range(3):
        c.failure()
    assert c.open_until == pytest.approx(clock.t + 25)  # capped at max_ejection_s


def test_circuit_ejects_on_failure_rate_over_the_window():
    clock = Clock()
    c = Circuit(
        CircuitSettings(
            consecutive_failures=100, failure_rate=0.5, failure_rate_min_requests=10, failure_rate_window_s=30
        ),
        clock,
    )
    states = []
    for i in range(10):
        states.append(c.success() if i % 2 else c.failure())
    assert all(s is None for s in states) and c.state == "closed"  # 5 of 9 when the 5th failed: too few
    assert c.failure() == "open"  # 6 failures of 11: over half
    clock2 = Clock()
    old = Circuit(
        CircuitSettings(
            consecutive_failures=100, failure_rate=0.5, failure_rate_min_requests=4, failure_rate_window_s=30
        ),
        clock2,
    )
    for _ in range(3):
        old.failure()
    clock2.t += 31  # those failures left the window
    old.success()
    assert old.failure() is None and old.state == "closed"


# -- weights and candidates ------------------------------------------------------------------------------


def _cfg(name: str, variant: str, role: str = "primary", weight: float | None = None) -> EngineConfig:
    return EngineConfig(
        name=name,
        kind="vllm",
        base_url="http://127.0.0.1:9/v1",
        model="m",
        variant=variant,
        role=role,
        weight=weight,
        serves=["omni"],
    )


def _pool(*configs: EngineConfig, seed: int = 1) -> EnginePool:
    pool = EnginePool(
        [build_engine(c) for c in configs], Metrics(CollectorRegistry()), routing=RoutingSettings(seed=seed)
    )
    for name in pool.engines:
        pool._healthy[name] = True
    return pool


def test_base_weights_give_a_canary_ten_percent_and_primaries_the_rest():
    infos = [
        EngineInfo("a", "int4", "primary", ("m",)),
        EngineInfo("b", "int4", "primary", ("m",)),
        EngineInfo("c", "int4", "canary", ("m",)),
        EngineInfo("f", "bf16", "fallback", ("m",)),
    ]
    assert base_weights(infos)["m"] == pytest.approx({"a": 0.45, "b": 0.45, "c": 0.1, "f": 0.0})
    infos[2] = EngineInfo("c", "int4", "canary", ("m",), 0.25)
    assert base_weights(infos)["m"]["c"] == pytest.approx(0.25)
    only_fallbacks = [
        EngineInfo("f1", "bf16", "fallback", ("x",)),
        EngineInfo("f2", "fp16", "fallback", ("x",)),
    ]
    assert base_weights(only_fallbacks)["x"] == pytest.approx({"f1": 0.5, "f2": 0.5})


def test_candidates_draw_the_first_engine_by_weight_and_keep_the_others_as_failover():
    pool = _pool(_cfg("int4", "int4"), _cfg("next", "int4", "canary", 0.1), _cfg("bf16", "bf16", "fallback"))
    firsts = Counter(pool.candidates("omni")[0].name for _ in range(20_000))
    assert firsts["bf16"] == 0
    assert 0.08 < firsts["next"] / 20_000 < 0.12
    order = [e.name for e in pool.candidates("omni")]
    assert sorted(order) == ["bf16", "int4", "next"] and order[-1] == "bf16"


def test_candidates_put_ejected_down_and_full_engines_last():
    pool = _pool(_cfg("int4", "int4"), _cfg("bf16", "bf16", "fallback"))
    for _ in range(5):
        pool.report_failure("int4")
    assert pool.circuit_state("int4") == "open" and pool.engine_state("int4") == "ejected"
    assert [e.name for e in pool.candidates("omni")] == ["bf16", "int4"]
    # With another engine available, an ejected one is not admitted; alone, it is (panic mode).
    assert not pool.acquire(pool.engines["int4"])
    pool._healthy["bf16"] = False
    assert pool.acquire(pool.engines["int4"])

    pool2 = _pool(_cfg("int4", "int4"), _cfg("bf16", "bf16", "fallback"))
    pool2.set_table(RoutingTable(version=2, weights=pool2.table.weights, limits={"int4": 1}))
    assert pool2.acquire(pool2.engines["int4"])
    assert [e.name for e in pool2.candidates("omni")] == ["bf16", "int4"]
    assert not pool2.acquire(pool2.engines["int4"])
    pool2.release("int4")
    assert pool2.candidates("omni")[0].name == "int4"


def test_pool_reports_feed_the_window_and_the_engine_state_gauge():
    registry = CollectorRegistry()
    pool = EnginePool([build_engine(_cfg("int4", "int4"))], Metrics(registry))
    pool._set_health(pool.engines["int4"], True)
    for i in range(50):
        pool.report_success("int4", 0.1 + i / 1000, None, 0.5)
    pool.report_failure("int4")
    s = pool.summaries()["int4"]
    assert (s.ok, s.errors, s.count("first_audio")) == (50, 1, 0)
    assert s.percentile("ttft", 0.5) == pytest.approx(0.125, rel=0.03)
    assert registry.get_sample_value("omnigate_engine_state", {"engine": "int4", "state": "serving"}) == 1
    assert registry.get_sample_value("omnigate_engine_state", {"engine": "int4", "state": "down"}) == 0


# -- windows and histograms --------------------------------------------------------------------------------


def test_bucketed_percentiles_are_within_two_percent_and_merge_like_the_raw_samples():
    rng = np.random.default_rng(3)
    a = rng.lognormal(mean=-1.2, sigma=0.6, size=4000)
    b = rng.lognormal(mean=-0.5, sigma=0.3, size=1000)
    for q in (0.5, 0.95, 0.99):
        assert quantile(bucket_counts(a), q) == pytest.approx(np.quantile(a, q), rel=0.025)
    merged = EngineSummary(ok=4000, latency={"ttft": bucket_counts(a)}).merge(
        EngineSummary(ok=1000, latency={"ttft": bucket_counts(b)})
    )
    both = np.concatenate([a, b])
    assert merged.ok == 5000
    assert merged.percentile("ttft", 0.99) == pytest.approx(np.quantile(both, 0.99), rel=0.025)
    again = EngineSummary.from_dict(merged.to_dict())
    assert again.percentile("ttft", 0.99) == merged.percentile("ttft", 0.99)


def test_outcome_window_forgets_what_left_the_window():
    clock = Clock()
    w = OutcomeWindow(max_samples=100, clock=clock, window_s=60, slots=30)  # 2 s slots
    w.success(5.0, None, 6.0)
    w.failure()
    clock.t += 30
    assert (w.summary().ok, w.summary().errors) == (1, 1)
    assert w.summary(20).ok == 0  # a shorter window than the one kept
    clock.t += 32
    w.success(0.2, 0.3, 1.0)
    s = w.summary()
    assert (s.ok, s.errors) == (1, 0)
    values, samples = s.values()
    assert values["ttft_p99"] == pytest.approx(0.2, rel=0.02) and samples["ttft_p99"] == 1
    assert values["first_audio_p50"] == pytest.approx(0.3, rel=0.02)
    assert values["error_rate"] == 0.0 and values["wer"] is None


# -- telemetry parsing -----------------------------------------------------------------------------------

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="q"} 7.0
vllm:num_requests_running{engine="1",model_name="q"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="q"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="q"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="q"} 0.91
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="q"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="q"} 90.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="q"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="q"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="q"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="q"} 20.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="q"} 1234.0
"""

DCGM_TEXT = """\
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",device="nvidia0",Hostname="h"} 8000
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b",device="nvidia1",Hostname="h"} 72000
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",device="nvidia0",Hostname="h"} 72000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b",device="nvidia1",Hostname="h"} 8000
"""


def test_parse_vllm_metrics():
    r = parse_vllm(VLLM_TEXT)
    assert (r.requests_running, r.requests_waiting, r.kv_cache_usage) == (12.0, 3.0, 0.91)
    assert r.ttft_buckets == {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    # P99 lies in the (0.5, 1.0] bucket: 0.5 + 0.5 * (99 - 90) / 10, as PromQL interpolates.
    assert histogram_quantile(0.99, r.ttft_buckets) == pytest.approx(0.95)
    assert histogram_quantile(0.5, r.ttft_buckets) == pytest.approx(0.1)
    later = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 110.0}
    assert histogram_quantile(0.99, bucket_delta(later, r.ttft_buckets)) == pytest.approx(1.0)  # all in +Inf
    assert bucket_delta({0.1: 1.0, float("inf"): 1.0}, r.ttft_buckets) == {
        0.1: 1.0,
        float("inf"): 1.0,
    }  # reset


def test_parse_dcgm_framebuffer():
    assert parse_dcgm(DCGM_TEXT) == pytest.approx(0.5)
    assert parse_dcgm(DCGM_TEXT, ["0"]) == pytest.approx(0.9)
    assert parse_dcgm(DCGM_TEXT, ["GPU-b"]) == pytest.approx(0.1)
    assert parse_dcgm(VLLM_TEXT) is None
