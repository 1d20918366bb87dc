"""Energy per token: the trapezoid over power samples while busy, the window, the estimate, and its rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engines.rollout.energy import EnergyBook, EnergyMeter, token_equivalents, trapezoid_joules
from engines.rollout.rollback import ControllerState, decide, route
from engines.rollout.routing import EngineInfo
from engines.rollout.rules import Rule, RuleAction, RuleSelector, default_rules
from engines.rollout.settings import ControllerSettings
from engines.rollout.snapshot import EngineSignals, Snapshot
from engines.rollout.telemetry import parse_dcgm_power

# A deployment serving BF16 first, with INT4 beside it: where preferring INT4 moves traffic.
INT4 = EngineInfo("omni-int4", "int4", "fallback", ("omni",))
BF16 = EngineInfo("omni-bf16", "bf16", "primary", ("omni",))
ENERGY = next(r for r in default_rules() if r.name == "energy-efficiency")
LATENCY = next(r for r in default_rules() if r.name == "int4-latency")


def test_trapezoid_counts_intervals_busy_at_either_end_and_leaves_idle_ones_out():
    # 100 W idle, a ramp to 300 W while busy from t=2 to t=4, back to idle.
    samples = [(0, 100, False), (1, 100, False), (2, 200, True), (3, 300, True), (4, 300, True),
               (5, 100, False), (6, 100, False)]  # fmt: skip
    # Intervals 1-2 (150 J), 2-3 (250), 3-4 (300), 4-5 (200) touch a busy sample; 0-1 and 5-6 do not.
    assert trapezoid_joules(samples) == pytest.approx(150 + 250 + 300 + 200)
    assert trapezoid_joules([(t, w, True) for t, w, _ in samples]) == pytest.approx(100 + 900 + 100)


def test_trapezoid_ignores_repeated_and_backward_timestamps():
    assert trapezoid_joules([(0, 100, True), (0, 500, True), (2, 100, True)]) == pytest.approx(600)
    assert trapezoid_joules([(5, 100, True), (4, 100, True)]) == 0.0


def test_the_meter_integrates_a_steady_load_and_its_window_slides():
    m = EnergyMeter(window_s=10, min_joules=0)
    for t in range(0, 21):
        m.observe("e", float(t), 250.0, busy=True)
    assert m.total_joules("e") == pytest.approx(20 * 250)
    assert m.window_joules("e") == pytest.approx(10 * 250)  # the intervals ending at 11..20: the last 10 s
    assert m.tokens_per_joule("e", 5000) == pytest.approx(2.0)


def test_a_missing_reading_or_a_long_gap_is_no_measurement():
    m = EnergyMeter(window_s=100, min_joules=0, max_gap_s=5)
    m.observe("e", 0, 200, True)
    m.observe("e", 1, 200, True)  # 200 J
    m.observe("e", 2, None, True)  # the scrape failed: the series restarts
    m.observe("e", 3, 200, True)
    m.observe("e", 4, 200, True)  # 200 J
    m.observe("e", 20, 200, True)  # 16 s later: not joined
    m.observe("e", 21, 200, True)  # 200 J
    assert m.total_joules("e") == pytest.approx(600)
    m.observe("e", 22, float("nan"), True)
    assert not m.has_power("e")


def test_tokens_per_joule_is_unknown_until_the_window_holds_min_joules():
    m = EnergyMeter(window_s=60, min_joules=50)
    m.observe("e", 0, 10, True)
    m.observe("e", 2, 10, True)  # 20 J
    assert m.tokens_per_joule("e", 1000) is None
    m.observe("e", 5, 10, True)  # 50 J
    assert m.tokens_per_joule("e", 1000) == pytest.approx(20)
    assert m.tokens_per_joule("other", 1000) is None


def test_speech_seconds_count_as_token_equivalents():
    assert token_equivalents(100, 2.0, 12.5) == pytest.approx(125)
    assert token_equivalents(0, 0.0, 12.5) == 0


def test_a_requests_estimate_is_its_tokens_times_the_engines_joules_per_token():
    book = EnergyBook(audio_tokens_per_s=12.5)
    assert book.estimate("e", 100, 0.0) is None  # no power telemetry: no estimate, not zero
    book.update({"e": 0.02, "dark": None})
    assert book.estimate("e", 100, 0.0) == pytest.approx(2.0)
    assert book.estimate("e", 0, 4.0) == pytest.approx(50 * 0.02)
    assert book.estimate("e", 0, 0.0) is None
    assert book.estimate("dark", 100, 0.0) is None
    assert book.estimate(None, 100, 0.0) is None


DCGM = """# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-aaa",modelName="NVIDIA H200"} 412.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-bbb",modelName="NVIDIA H200"} 388.0
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0"} 1000
"""


def test_dcgm_power_sums_the_engines_gpus():
    assert parse_dcgm_power(DCGM) == pytest.approx(800.5)
    assert parse_dcgm_power(DCGM, ["1"]) == pytest.approx(388.0)
    assert parse_dcgm_power(DCGM, ["GPU-aaa"]) == pytest.approx(412.5)
    assert parse_dcgm_power(DCGM, ["7"]) is None
    assert parse_dcgm_power("# nothing\n") is None


# -- the rule --------------------------------------------------------------------------------------------


def cfg(*rules: Rule) -> ControllerSettings:
    return ControllerSettings(rules=list(rules), min_dwell_s=0, cooldown_s=0, max_switches_per_hour=100)


def run(series, config, seconds, state=None, start=0, infos=(INT4, BF16)):
    state = state or ControllerState()
    trs, holds = [], []
    for t in range(start, start + seconds):
        values = series(float(t))
        engines = {
            i.name: EngineSignals(info=i, values=values.get(i.name, {}),
                                  samples={k: 100 for k in values.get(i.name, {})})
            for i in infos
        }  # fmt: skip
        d = decide(Snapshot(now=float(t), engines=engines), state, config)
        state = d.state
        trs.extend(d.transitions)
        holds.extend((t, h.key, h.reason) for h in d.holds)
    return trs, holds, state


def weights(state):
    return route({i.name: i for i in (INT4, BF16)}, state).weights["omni"]


def test_the_default_rule_is_tokens_per_joule_under_100_prefers_int4():
    assert ENERGY.signal == "tokens_per_joule" and ENERGY.below == 100 and ENERGY.above is None
    assert ENERGY.action.kind == "shift" and ENERGY.action.to_variants == ["int4"]
    assert "int4" not in ENERGY.select.variants and "bf16" in ENERGY.select.variants
    assert ENERGY.recover_above == 125


def test_bf16_under_100_tokens_per_joule_for_for_s_shifts_its_traffic_to_int4_and_back():
    def series(t: float):
        tpj = 60.0 if 100 <= t < 1000 else 140.0
        return {"omni-bf16": {"tokens_per_joule": tpj}, "omni-int4": {"tokens_per_joule": 400.0}}

    trs, _, state = run(series, cfg(ENERGY), 2000)
    fired = [(t.at, t.action, t.reason, t.engine) for t in trs]
    # Breached from 100, held for_s 300: fires at 400. Above 125 from 1000, for recover_for_s 600: back at 1600.
    assert fired == [(400.0, "shift", "energy-efficiency", "omni-bf16"),
                     (1600.0, "restore", "energy-efficiency", "omni-bf16")]  # fmt: skip
    assert trs[0].detail["below"] == 100 and trs[0].detail["value"] == 60.0
    assert trs[0].detail["targets"] == {"omni": ["omni-int4"]}
    assert trs[1].detail["recover_above"] == 125
    assert state.incidents == {}


def test_between_100_and_125_the_shift_stays_in_force_hysteresis():
    def series(t: float):
        tpj = 60.0 if t < 400 else 110.0
        return {"omni-bf16": {"tokens_per_joule": tpj}}

    trs, _, state = run(series, cfg(ENERGY), 3000)
    assert [t.action for t in trs] == ["shift"]
    assert weights(state)["omni-bf16"] == pytest.approx(0.05)


def test_an_int4_engine_rolled_back_for_latency_is_no_destination_for_energy():
    def series(t: float):
        return {
            "omni-int4": {"upstream_ttft_per_1k_prompt_tokens_p99": 0.9},
            "omni-bf16": {"tokens_per_joule": 50.0},
        }

    # INT4 carries half the traffic (an A/B split); its latency rolls it back to BF16 after 30 s.
    infos = (
        EngineInfo("omni-int4", "int4", "primary", ("omni",), 0.5),
        EngineInfo("omni-bf16", "bf16", "primary", ("omni",), 0.5),
    )
    trs, holds, state = run(series, cfg(LATENCY, ENERGY), 1000, infos=infos)
    assert [(t.at, t.action, t.reason) for t in trs] == [(30.0, "shift", "int4-latency")]
    assert (300, "energy-efficiency@omni-bf16", "no-target") in holds
    assert route({i.name: i for i in infos}, state).weights["omni"]["omni-bf16"] == pytest.approx(0.95)


def test_a_latency_roll_back_of_int4_ends_the_energy_shift_onto_it():
    def series(t: float):
        return {
            "omni-int4": {"upstream_ttft_per_1k_prompt_tokens_p99": 0.9 if t >= 500 else 0.2},
            "omni-bf16": {"tokens_per_joule": 50.0},
        }

    trs, _, state = run(series, cfg(LATENCY, ENERGY), 700)
    assert [(t.at, t.action, t.reason) for t in trs] == [
        (300.0, "shift", "energy-efficiency"),
        (530.0, "shift", "int4-latency"),
    ]
    assert trs[1].detail["ends"] == ["energy-efficiency@omni-bf16"]
    assert list(state.incidents) == ["int4-latency@omni-int4"]
    # The energy shift gone, INT4 (a fallback) has no share of its own left: BF16 serves everything.
    assert weights(state)["omni-bf16"] == pytest.approx(1.0)


def test_an_unknown_figure_resets_the_timer():
    def series(t: float):
        # no power telemetry every 100th second: the breach never lasts for_s
        return {"omni-bf16": {"tokens_per_joule": None if t % 100 == 0 else 50.0}}

    trs, _, _ = run(series, cfg(ENERGY), 2000)
    assert trs == []


def test_a_rule_sets_exactly_one_of_above_and_below():
    action = RuleAction(kind="shift", to_variants=["int4"])
    with pytest.raises(ValidationError, match="exactly one of above and below"):
        Rule(name="x", signal="tokens_per_joule", above=1, below=2, action=action)
    with pytest.raises(ValidationError, match="exactly one of above and below"):
        Rule(name="x", signal="tokens_per_joule", action=action)
    with pytest.raises(ValidationError, match="recover_above must not be under below"):
        Rule(name="x", signal="tokens_per_joule", below=100, recover_above=90, action=action)
    with pytest.raises(ValidationError, match="recovers above recover_above"):
        Rule(name="x", signal="tokens_per_joule", below=100, recover_below=90, action=action)
    r = Rule(
        name="x", select=RuleSelector(variants=["bf16"]), signal="tokens_per_joule", below=80, action=action
    )
    assert r.recover_above == pytest.approx(100)
