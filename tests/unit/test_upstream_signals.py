"""The engine's own latencies as window signals: recorded per request, merged across replicas like the rest."""

from __future__ import annotations

import pytest

from engines.rollout.routing import EngineInfo
from engines.rollout.signals import WHOLE_ANSWER_MIN_TOKENS, EngineSummary, OutcomeWindow
from engines.rollout.snapshot import EngineSignals


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
        # Not streamed: no first token, for the client or the engine; the whole answer took 2 s.
        w.success(2.0, 2.0, 2.0, upstream_ttft_s=None, upstream_e2e_s=1.9)
    values, samples = w.summary().values()
    assert values["ttft_p99"] == pytest.approx(0.9, rel=0.03) and samples["ttft_p99"] == 30
    assert samples["first_audio_p99"] == 0
    assert values["e2e_p99"] == pytest.approx(2.0, rel=0.03) and samples["e2e_p99"] == 60
    assert values["upstream_ttft_p99"] == pytest.approx(0.05, rel=0.03)
    assert samples["upstream_ttft_p99"] == 30 and samples["upstream_e2e_p99"] == 60
    assert values["upstream_e2e_p50"] == pytest.approx(0.3, rel=0.03)


def test_a_whole_answers_engine_time_per_output_token_is_its_duration_over_its_tokens():
    w = OutcomeWindow(clock=Clock())
    for _ in range(10):
        w.success(None, None, 2.1, upstream_ttft_s=None, upstream_e2e_s=2.0, tokens=40, prompt_tokens=30)
    values, samples = w.summary().values()
    assert values["upstream_whole_tpot_p99"] == pytest.approx(0.05, rel=0.03)
    assert samples["upstream_whole_tpot_p99"] == 10
    # Neither the streamed figures nor the normalised TTFT get a sample from a whole answer.
    assert samples["upstream_tpot_p99"] == 0 and samples["upstream_ttft_per_1k_prompt_tokens_p99"] == 0


@pytest.mark.parametrize(
    ("tokens", "audio_s", "streamed"),
    [
        (WHOLE_ANSWER_MIN_TOKENS - 1, 0.0, False),  # a short answer: its prefill would be most of it
        (40, 3.0, False),  # speech: its seconds add no tokens to divide by
        (40, 0.0, True),  # streamed: timed by its first token and its decode
    ],
)
def test_no_whole_answer_sample_where_the_duration_is_not_mostly_its_tokens(tokens, audio_s, streamed):
    w = OutcomeWindow(clock=Clock())
    w.success(None, None, 2.1, 0.1 if streamed else None, 2.0, tokens, audio_s, 30)
    assert w.summary().values()[1]["upstream_whole_tpot_p99"] == 0


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
