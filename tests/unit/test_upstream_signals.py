"""The engine's own latencies as window signals: recorded per request, merged across replicas like the rest."""

from __future__ import annotations

import pytest

from engines.routing import EngineInfo
from engines.signals import EngineSummary, OutcomeWindow
from engines.snapshot import EngineSignals


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_streamed_and_whole_answers_feed_the_engine_signals_they_have():
    w = OutcomeWindow(clock=Clock())
    for _ in range(30):
        # A streamed request: the client waited 0.9 s (a slow pre-policy), the engine 0.05 s.
        w.success(0.9, None, 1.2, upstream_ttft_s=0.05, upstream_e2e_s=0.3)
    for _ in range(30):
        w.success(2.0, None, 2.0, upstream_ttft_s=None, upstream_e2e_s=1.9)  # not streamed: no first token
    values, samples = w.summary().values()
    assert values["ttft_p99"] == pytest.approx(2.0, rel=0.03)
    assert values["upstream_ttft_p99"] == pytest.approx(0.05, rel=0.03)
    assert samples["upstream_ttft_p99"] == 30 and samples["upstream_e2e_p99"] == 60
    assert values["upstream_e2e_p50"] == pytest.approx(0.3, rel=0.03)


def test_replicas_summaries_merge_the_engine_signals():
    a, b = OutcomeWindow(clock=Clock()), OutcomeWindow(clock=Clock())
    for _ in range(10):
        a.success(0.1, None, 0.2, 0.05, 0.2)
        b.success(0.1, None, 0.2, 0.8, 1.0)
    merged = EngineSummary.from_dict(a.summary().to_dict()).merge(
        EngineSummary.from_dict(b.summary().to_dict())
    )
    values, samples = merged.values()
    assert samples["upstream_ttft_p99"] == 20
    assert values["upstream_ttft_p99"] == pytest.approx(0.8, rel=0.03)
    # A summary from a replica that does not record the engine's figures yet merges as empty.
    old = {k: v for k, v in a.summary().to_dict().items() if k != "latency"} | {"latency": {"ttft": {}}}
    assert EngineSummary.from_dict(old).merge(merged).count("upstream_ttft") == 20


def test_the_engine_signal_needs_its_samples():
    info = EngineInfo("omni-int4", "int4", "primary", ("omni",), None)
    e = EngineSignals(info, values={"upstream_ttft_p99": 0.9}, samples={"upstream_ttft_p99": 3})
    assert e.reading("upstream_ttft_p99", min_samples=20) is None
    assert (
        EngineSignals(info, values={"upstream_ttft_p99": 0.9}, samples={"upstream_ttft_p99": 20}).reading(
            "upstream_ttft_p99", min_samples=20
        )
        == 0.9
    )
