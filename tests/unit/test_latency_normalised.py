"""Latency signals that judge the engine, not one tenant's prompts: the window, the tenant cap, and ``decide``.

No HTTP: an :class:`OutcomeWindow` on a fake clock is fed what the pipeline reports, its summary
becomes the controller's snapshot, and the pure :func:`engines.rollout.rollback.decide` runs the shipped rules.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engines.rollout.rollback import ControllerState, decide
from engines.rollout.routing import EngineInfo
from engines.rollout.rules import default_rules
from engines.rollout.settings import ControllerSettings, SignalSettings
from engines.rollout.signals import EngineSummary, OutcomeWindow, tenant_weights
from engines.rollout.snapshot import EngineSignals, Snapshot

SHIPPED = next(r for r in default_rules() if r.name == "int4-latency")
SIGNALS = SignalSettings()
HUGE_PROMPT = 10_000  # tokens: a 40,000-character prompt


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _window(clock: Clock, cap: float = SIGNALS.tenant_share_cap) -> OutcomeWindow:
    return OutcomeWindow(
        clock=clock,
        window_s=60.0,
        tenant_share_cap=cap,
        prompt_tokens_floor=SIGNALS.prompt_tokens_floor,
    )


def _served(
    w: OutcomeWindow, upstream_ttft_s: float, prompt_tokens: int, tenant: str | None, tokens: int = 20
) -> None:
    w.success(
        upstream_ttft_s + 0.01,
        None,
        upstream_ttft_s + 0.5,
        upstream_ttft_s,
        upstream_ttft_s + 0.4,
        tokens,
        0.0,
        prompt_tokens,
        tenant=tenant,
    )


def _engine_prefill(prompt_tokens: int, base_s: float = 0.03, per_1k_s: float = 0.15) -> float:
    """An engine's time to first token: a fixed cost plus a prefill rate."""
    return base_s + per_1k_s * prompt_tokens / 1000


def _attack(w: OutcomeWindow, clock: Clock, base_s: float = 0.03) -> None:
    """60 s of traffic: three tenants' short prompts, and one 40,000-character prompt a second from 'bulk'."""
    for _ in range(60):
        clock.t += 1.0
        for tenant in ("acme", "globex", "initech"):
            for _ in range(3):
                _served(w, _engine_prefill(40, base_s), 40, tenant)
        _served(w, _engine_prefill(HUGE_PROMPT, base_s), HUGE_PROMPT, "bulk")


def _snapshot(now: float, summary: EngineSummary) -> Snapshot:
    values, samples = summary.values()
    int4 = EngineInfo("omni-int4", "int4", "primary", ("omni",))
    bf16 = EngineInfo("omni-bf16", "bf16", "fallback", ("omni",))
    return Snapshot(
        now=now,
        engines={
            "omni-int4": EngineSignals(info=int4, values=values, samples=samples),
            "omni-bf16": EngineSignals(info=bf16),
        },
    )


def _shifts(summaries: list[tuple[float, EngineSummary]]) -> list:
    """Run the shipped rules over one summary per tick; the shifts they made."""
    config = ControllerSettings()
    state = ControllerState()
    out = []
    for now, summary in summaries:
        d = decide(_snapshot(now, summary), state, config)
        state = d.state
        out += [t for t in d.transitions if t.action == "shift"]
    return out


def _ticks(summary: EngineSummary) -> list[tuple[float, EngineSummary]]:
    """The same window, read at ticks spanning more than the rule's for_s."""
    return [(t, summary) for t in range(0, int(SHIPPED.for_s) + 5, 1)]


# -- the window ------------------------------------------------------------------------------------------


def test_one_tenants_huge_prompts_raise_the_raw_ttft_but_not_the_engines_ttft_per_prompt_token():
    clock = Clock()
    w = _window(clock)
    _attack(w, clock)
    values, samples = w.summary().values()
    assert SHIPPED.above is not None
    # The raw signal is what the attack moved: its P99 is the huge prompt's prefill.
    assert values["upstream_ttft_p99"] == pytest.approx(_engine_prefill(HUGE_PROMPT), rel=0.03)
    assert values["upstream_ttft_p99"] > SHIPPED.above
    # Per 1,000 prompt tokens (a short prompt counts as 1,000), the engine is as fast as it is for everyone.
    normalised = values["upstream_ttft_per_1k_prompt_tokens_p99"]
    assert normalised is not None and normalised < SHIPPED.recover_below
    assert samples["upstream_ttft_per_1k_prompt_tokens_p99"] >= SHIPPED.min_samples


def test_a_short_prompts_ttft_per_1k_prompt_tokens_is_its_ttft():
    clock = Clock()
    w = _window(clock)
    for _ in range(50):
        _served(w, 0.25, 12, "acme")
    values, _ = w.summary().values()
    assert values["upstream_ttft_per_1k_prompt_tokens_p50"] == pytest.approx(0.25, rel=0.03)
    assert values["upstream_ttft_p50"] == pytest.approx(0.25, rel=0.03)


def test_a_long_prompts_ttft_is_divided_by_its_thousands_of_prompt_tokens():
    clock = Clock()
    w = _window(clock)
    for _ in range(50):
        _served(w, 2.0, 8000, "acme")
    values, _ = w.summary().values()
    assert values["upstream_ttft_per_1k_prompt_tokens_p50"] == pytest.approx(0.25, rel=0.03)


def test_no_prompt_tokens_reported_no_sample_of_the_normalised_ttft():
    clock = Clock()
    w = _window(clock)
    for _ in range(30):
        _served(w, 0.2, 0, "acme")
    values, samples = w.summary().values()
    assert values["upstream_ttft_per_1k_prompt_tokens_p99"] is None
    assert samples["upstream_ttft_per_1k_prompt_tokens_p99"] == 0
    assert samples["upstream_ttft_p99"] == 30


def test_time_per_output_token_is_the_decode_after_the_first_token():
    clock = Clock()
    w = _window(clock)
    for _ in range(40):
        # first token at 0.5 s, the last of 21 at 0.5 + 20 * 0.02 s
        w.success(0.5, None, 1.0, 0.5, 0.9, 21, 0.0, 5000, tenant="acme")
    # speech adds no tokens to divide by; a one-token answer has no time between tokens
    w.success(0.5, 0.6, 3.0, 0.5, 2.9, 5, 2.0, 100, tenant="acme")
    w.success(0.5, None, 0.6, 0.5, 0.55, 1, 0.0, 100, tenant="acme")
    values, samples = w.summary().values()
    assert values["upstream_tpot_p50"] == pytest.approx(0.02, rel=0.03)
    assert samples["upstream_tpot_p50"] == 40


def test_a_tenant_flooding_the_window_weighs_its_capped_share():
    clock = Clock()
    w = _window(clock, cap=0.25)
    for tenant in ("acme", "globex", "initech"):
        for _ in range(10):
            _served(w, 0.1, 40, tenant)
    for _ in range(1000):
        _served(w, 0.9, 40, "flood")
    summary = w.summary()
    values, samples = summary.values()
    # 30 others' samples, flood capped at a quarter of the total: 10 weighted samples of its 1000.
    assert summary.count("upstream_ttft") == pytest.approx(40.0)
    assert samples["upstream_ttft_p50"] == 40
    assert values["upstream_ttft_p50"] == pytest.approx(0.1, rel=0.03)
    # Every latency is capped the same way, the client's included.
    assert values["ttft_p50"] == pytest.approx(0.11, rel=0.03)
    assert summary.ok == 1030  # outcomes are counted, not weighed


def test_one_tenant_alone_keeps_every_sample():
    clock = Clock()
    w = _window(clock, cap=0.25)
    for _ in range(100):
        _served(w, 0.9, 40, "only")
    values, samples = w.summary().values()
    assert samples["upstream_ttft_per_1k_prompt_tokens_p99"] == 100
    assert values["upstream_ttft_per_1k_prompt_tokens_p99"] == pytest.approx(0.9, rel=0.03)


def test_the_weighted_histograms_merge_across_replicas_and_survive_the_shared_store():
    clock = Clock()
    a, b = _window(clock, cap=0.25), _window(clock, cap=0.25)
    for w in (a, b):
        for tenant in ("acme", "globex", "initech"):
            for _ in range(10):
                _served(w, 0.1, 40, tenant)
        for _ in range(500):
            _served(w, 0.9, 40, "flood")
    merged = EngineSummary.from_dict(a.summary().to_dict()).merge(
        EngineSummary.from_dict(b.summary().to_dict())
    )
    assert merged.count("upstream_ttft") == pytest.approx(80.0)
    assert merged.percentile("upstream_ttft", 0.5) == pytest.approx(0.1, rel=0.03)
    assert "flood" not in str(a.summary().to_dict())  # tenant names stay inside the replica


# -- the cap, a pure rule --------------------------------------------------------------------------------


def test_tenant_weights_examples():
    assert tenant_weights({}, 0.25) == {}
    assert tenant_weights({"a": 7}, 0.25) == {"a": 1.0}
    assert tenant_weights({"a": 10, "b": 10, "c": 10, "d": 10}, 0.25) == dict.fromkeys("abcd", 1.0)
    # Two tenants cannot both be under a quarter: the larger weighs as much as the smaller.
    assert tenant_weights({"a": 100, "b": 10}, 0.25) == {"a": pytest.approx(0.1), "b": 1.0}
    # 30 others: the flood is brought to 10 of 40.
    w = tenant_weights({"a": 10, "b": 10, "c": 10, "flood": 1000}, 0.25)
    assert w["flood"] == pytest.approx(0.01) and w["a"] == w["b"] == w["c"] == 1.0
    assert tenant_weights({"a": 100, "b": 10, "c": 0}, 1.0) == {"a": 1.0, "b": 1.0}


@given(
    counts=st.dictionaries(st.text(max_size=3), st.integers(min_value=0, max_value=10_000), max_size=12),
    cap=st.floats(min_value=0.01, max_value=1.0),
)
def test_tenant_weights_hold_every_tenant_to_its_share_and_leave_the_small_alone(counts, cap):
    weights = tenant_weights(counts, cap)
    present = {t: n for t, n in counts.items() if n > 0}
    assert set(weights) == set(present)
    if not present:
        return
    share = max(cap, 1.0 / len(present))
    effective = {t: present[t] * weights[t] for t in present}
    total = sum(effective.values())
    for t, n in present.items():
        assert 0.0 < weights[t] <= 1.0
        assert effective[t] <= share * total * (1 + 1e-9) + 1e-9
        if weights[t] < 1.0:
            # weighed down only to the common level, never below a tenant that kept all of its samples
            assert all(effective[t] >= effective[u] - 1e-6 for u in present)
        else:
            assert effective[t] == n
    assert max(effective.values()) == pytest.approx(min(max(present.values()), share * total), rel=1e-6)


# -- decide, with the shipped rules ----------------------------------------------------------------------


def test_the_shipped_int4_latency_rule_is_not_moved_by_one_tenants_huge_prompts():
    clock = Clock()
    w = _window(clock)
    _attack(w, clock)
    assert _shifts(_ticks(w.summary())) == []


def test_the_shipped_int4_latency_rule_still_rolls_back_an_engine_slow_for_everyone():
    clock = Clock()
    w = _window(clock)
    _attack(w, clock, base_s=SHIPPED.above + 0.2 if SHIPPED.above is not None else 1.0)
    [shift] = _shifts(_ticks(w.summary()))
    assert (shift.reason, shift.engine) == ("int4-latency", "omni-int4")
    assert shift.detail["signal"] == "upstream_ttft_per_1k_prompt_tokens_p99"
    assert shift.detail["targets"] == {"omni": ["omni-bf16"]}


def test_the_shipped_canary_latency_rule_reads_the_same_normalised_signal():
    rules = {r.name: r for r in default_rules()}
    assert rules["canary-latency"].signal == rules["int4-latency"].signal
