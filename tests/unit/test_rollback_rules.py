"""The decide steps of the raise-the-batch and offload rules, over scripted signal series (one tick a second).

The offload tests play the engines' side too: a sleep intent turns the engine's ``sleep_state`` gauge to the
sleep level on the next tick, a wake turns it back to 0 after ``wake_s`` seconds, as vLLM-Omni's gauge does.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from engines.rollout.rollback import ControllerState, Intent, Transition, decide, route
from engines.rollout.routing import EngineInfo, RoutingTable
from engines.rollout.rules import Rule, RuleAction, default_rules
from engines.rollout.settings import ControllerSettings, OffloadSettings
from engines.rollout.snapshot import EngineSignals, Snapshot
from engines.selection.pool import EnginePool, build_engine
from observability.metrics import Metrics

INT4 = EngineInfo("omni-int4", "int4", "primary", ("omni",))
BF16 = EngineInfo("omni-bf16", "bf16", "fallback", ("omni",))
RULES = {r.name: r for r in default_rules()}


def cfg(*rules: Rule, dwell: float = 0, cooldown: float = 0, retry_s: float = 30) -> ControllerSettings:
    return ControllerSettings(
        rules=list(rules),
        min_dwell_s=dwell,
        cooldown_s=cooldown,
        max_switches_per_hour=100,
        offload=OffloadSettings(retry_s=retry_s),
    )


def table(state: ControllerState, infos=(INT4, BF16)) -> RoutingTable:
    return route({i.name: i for i in infos}, state)


# -- P50 > 400 ms -> raise the batch limit -------------------------------------------------------------------


#: what the shipped latency-batch rule reads: the engine's own time to first token (per 1,000 prompt tokens)
P50 = RULES["latency-batch"].signal


def run_p50(
    p50,
    config: ControllerSettings,
    seconds: int,
    cap: float = 8.0,
    extra=None,
    max_num_seqs: float | None = 32.0,
    replicas: int = 1,
):
    state, transitions, tables = ControllerState(), [], {}
    seqs = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    for t in range(seconds):
        values = {P50: p50(t), "concurrency_cap": cap, **seqs, **((extra or {}).get("int4", lambda t: {})(t))}
        engines = {
            INT4.name: EngineSignals(info=INT4, values=values, samples={k: 100 for k in values}),
            BF16.name: EngineSignals(
                info=BF16, values={P50: 0.1, "concurrency_cap": cap, **seqs}, samples={P50: 100}
            ),
        }
        d = decide(Snapshot(now=float(t), engines=engines, replicas=replicas), state, config)
        state = d.state
        transitions += d.transitions
        tables[t] = table(state)
    return transitions, tables, state


def test_a_p50_over_400_ms_for_30_s_raises_the_cap_to_twice_within_the_ceiling_and_the_way_back_restores_it():
    rule = RULES["latency-batch"]
    assert rule.signal == "upstream_ttft_per_1k_prompt_tokens_p50" and rule.above == 0.4 and rule.for_s == 30
    assert rule.action.kind == "raise_concurrency" and rule.action.max_concurrency == 16
    trs, tables, _state = run_p50(lambda t: 0.55 if t < 100 else 0.2, cfg(rule, dwell=60), 300)
    assert [(t.at, t.action, t.engine) for t in trs] == [
        (30.0, "raise_concurrency", "omni-int4"),
        (220.0, "restore", "omni-int4"),  # below 0.3 from t=100, for recover_for_s=120
    ]
    assert trs[0].detail["limit"] == 16 and trs[0].detail["detected_at"] == 0.0
    assert tables[29].raised == {} and tables[30].raised == {"omni-int4": 16} and tables[30].limits == {}
    assert tables[219].raised == {"omni-int4": 16} and tables[220].raised == {}
    # The weights never moved: a raise changes only the cap.
    assert tables[30].weights == tables[0].weights


def test_the_ceiling_bounds_the_raise():
    rule = RULES["latency-batch"]
    trs, tables, _ = run_p50(lambda t: 0.9, cfg(rule), 40, cap=12.0)
    assert tables[35].raised == {"omni-int4": 16}  # 2 x 12 = 24, ceiling 16
    # A ceiling at or under the configured cap changes nothing, so nothing fires.
    low = rule.model_copy(update={"action": RuleAction(kind="raise_concurrency", max_concurrency=8)})
    trs, tables, _ = run_p50(lambda t: 0.9, cfg(low), 60, cap=8.0)
    assert trs == [] and tables[59].raised == {}


def test_the_raise_has_hysteresis_dwell_and_ignores_a_short_spike():
    rule = RULES["latency-batch"]
    # 20 s above the line, then 20 s below, repeatedly: never 30 s in a row.
    trs, _, _ = run_p50(lambda t: 0.6 if (t // 20) % 2 == 0 else 0.2, cfg(rule), 400)
    assert trs == []
    # Between recover_below (0.3) and above (0.4) the raise stays; min_dwell holds the way back.
    trs, tables, state = run_p50(lambda t: 0.6 if t < 40 else 0.35, cfg(rule), 400)
    assert [t.action for t in trs] == ["raise_concurrency"] and tables[399].raised == {"omni-int4": 16}
    trs, _, state = run_p50(lambda t: 0.6 if t < 40 else 0.1, cfg(rule, dwell=600), 400)
    assert [t.action for t in trs] == ["raise_concurrency"] and state.holds == {
        "latency-batch@omni-int4": "min-dwell"
    }


def test_the_engines_max_num_seqs_bounds_the_raise():
    rule = RULES["latency-batch"]
    # 2 x 8 = 16 is the rule's ceiling; the engine runs 12 at once.
    _, tables, _ = run_p50(lambda t: 0.9, cfg(rule), 40, max_num_seqs=12.0)
    assert tables[35].raised == {"omni-int4": 12}
    # The cap is the engine's whole, however many replicas share it (through Redis): so is the bound.
    _, tables, _ = run_p50(lambda t: 0.9, cfg(rule), 40, max_num_seqs=12.0, replicas=3)
    assert tables[35].raised == {"omni-int4": 12}
    # An engine that runs no more than its cap already: nothing to raise, nothing fires.
    trs, tables, state = run_p50(lambda t: 0.9, cfg(rule), 60, max_num_seqs=8.0)
    assert trs == [] and tables[59].raised == {} and state.holds == {"latency-batch@omni-int4": "no-target"}


def test_an_engine_that_declares_no_max_num_seqs_is_never_raised():
    trs, tables, state = run_p50(lambda t: 0.9, cfg(RULES["latency-batch"]), 60, max_num_seqs=None)
    assert trs == [] and tables[59].raised == {}
    assert state.holds == {"latency-batch@omni-int4": "no-target"}


def test_without_a_configured_cap_there_is_nothing_to_raise():
    rule = RULES["latency-batch"]
    state = ControllerState()
    for t in range(60):
        values = {P50: 0.9, "max_num_seqs": 32.0}
        engines = {INT4.name: EngineSignals(info=INT4, values=values, samples={P50: 100})}
        d = decide(Snapshot(now=float(t), engines=engines), state, cfg(rule))
        state = d.state
        assert d.transitions == ()
    assert state.holds == {"latency-batch@omni-int4": "no-target"}


def _engine(name: str, **kw):
    return build_engine(
        EngineConfig(name=name, kind="vllm", base_url="http://127.0.0.1:9/v1", model="m", serves=["x"], **kw)
    )


def test_the_pool_applies_a_raise_but_a_vram_limit_or_overload_still_wins():
    a = _engine("a", max_in_flight=8, max_in_flight_overloaded=4)
    pool = EnginePool([a], Metrics(CollectorRegistry()))
    assert pool.limit("a") == 8 and pool.configured_cap("a") == 8
    pool.set_table(RoutingTable(version=1, weights=pool.table.weights, raised={"a": 16}))
    assert pool.limit("a") == 16
    pool.set_table(RoutingTable(version=2, weights=pool.table.weights, raised={"a": 16}, limits={"a": 6}))
    assert pool.limit("a") == 6
    pool.set_table(RoutingTable(version=3, weights=pool.table.weights, raised={"a": 16}))
    pool.set_overloaded(True)
    assert pool.limit("a") == 4


def test_vram_pressure_and_a_raise_together_keep_the_lower_cap():
    trs, tables, _ = run_p50(
        lambda t: 0.9,
        cfg(RULES["latency-batch"], RULES["vram-pressure"]),
        60,
        extra={"int4": lambda t: {"vram_usage": 0.95, "requests_running": 8.0}},
    )
    assert {t.action for t in trs} == {"raise_concurrency", "limit_concurrency"}
    assert tables[59].raised == {"omni-int4": 16} and tables[59].limits == {"omni-int4": 4}


# -- VRAM > 90 % for 30 s -> offload: limit, and put an idle variant on the same GPU to sleep --------------------


class Engines:
    """The engines' side: gauges that follow the intents the controller sends."""

    def __init__(self, wake_s: float = 3.0) -> None:
        self.wake_s = wake_s
        self.gauge: dict[str, float] = {INT4.name: 0.0, BF16.name: 0.0}
        self.pending_wake: dict[str, float] = {}
        self.sent: list[tuple[float, Intent]] = []

    def apply(self, now: float, intents) -> None:
        for i in intents:
            self.sent.append((now, i))
            if i.action == "sleep":
                self.gauge[i.engine] = float(i.level)
                self.pending_wake.pop(i.engine, None)
            else:
                self.pending_wake.setdefault(i.engine, now + self.wake_s)

    def tick(self, now: float) -> None:
        for name, at in list(self.pending_wake.items()):
            if now >= at:
                self.gauge[name] = 0.0
                self.pending_wake.pop(name)


def run_offload(series, config, seconds, gpus=None, engines: Engines | None = None, state=None, start=0):
    gpus = gpus or {INT4.name: ("0",), BF16.name: ("0",)}
    engines = engines or Engines()
    state = state or ControllerState()
    transitions: list[Transition] = []
    tables = {}
    for t in range(start, start + seconds):
        now = float(t)
        engines.tick(now)
        values = series(t)
        snap = Snapshot(
            now=now,
            engines={
                i.name: EngineSignals(
                    info=i,
                    values={**values.get(i.name, {}), "sleep_state": engines.gauge[i.name]},
                    samples={k: 100 for k in values.get(i.name, {})},
                    gpus=gpus[i.name],
                )
                for i in (INT4, BF16)
            },
        )
        d = decide(snap, state, config)
        state = d.state
        transitions += d.transitions
        engines.apply(now, d.intents)
        tables[t] = table(state)
    return transitions, tables, state, engines


def vram(t: int, until: int = 100) -> dict:
    return {INT4.name: {"vram_usage": 0.95 if t < until else 0.5, "requests_running": 24.0}, BF16.name: {}}


def test_vram_pressure_limits_the_engine_and_sleeps_the_idle_variant_on_its_gpu_then_wakes_it_on_the_way_back():
    rule = RULES["vram-pressure"]
    assert rule.action.sleep_idle and rule.action.sleep_level == 1
    trs, tables, state, engines = run_offload(vram, cfg(rule), 200)
    assert [(t.at, t.action, t.engine) for t in trs] == [
        (30.0, "limit_concurrency", "omni-int4"),
        (30.0, "sleep", "omni-bf16"),
        (160.0, "restore", "omni-int4"),
        (160.0, "wake", "omni-bf16"),
        (163.0, "awake", "omni-bf16"),  # the gauge said awake 3 s after the wake
    ]
    assert [(at, i.action, i.engine, i.level) for at, i in engines.sent] == [
        (30.0, "sleep", "omni-bf16", 1),
        (160.0, "wake", "omni-bf16", 1),
    ]
    assert tables[50].limits == {"omni-int4": 12}
    assert set(tables[50].weights["omni"]) == {"omni-int4", "omni-bf16"}
    assert tables[50].weights["omni"]["omni-bf16"] == 0.0
    assert state.sleeping == {}


def test_an_engine_with_traffic_work_in_flight_or_on_another_gpu_is_not_put_to_sleep():
    rule = RULES["vram-pressure"]

    def busy(t):
        return {**vram(t), BF16.name: {"in_flight": 2.0}}

    trs, _, _, engines = run_offload(busy, cfg(rule), 60)
    assert [t.action for t in trs] == ["limit_concurrency"] and engines.sent == []
    trs, _, _, engines = run_offload(vram, cfg(rule), 60, gpus={INT4.name: ("0",), BF16.name: ("1",)})
    assert [t.action for t in trs] == ["limit_concurrency"] and engines.sent == []
    # Unknown GPUs: no sharing can be shown, so nothing sleeps.
    trs, _, _, engines = run_offload(vram, cfg(rule), 60, gpus={INT4.name: (), BF16.name: ()})
    assert engines.sent == []
    # sleep_variants narrows the choice.
    only_int8 = rule.model_copy(
        update={"action": rule.action.model_copy(update={"sleep_variants": ["int8"]})}
    )
    _, _, _, engines = run_offload(vram, cfg(only_int8), 60)
    assert engines.sent == []


def test_traffic_shifts_to_a_sleeping_engine_only_after_its_gauge_confirms_it_awake():
    latency = Rule(
        name="int4-latency",
        select={"variants": ["int4"]},
        signal="upstream_ttft_p99",
        above=0.6,
        for_s=5,
        min_samples=20,
        action=RuleAction(kind="shift", to_variants=["bf16"]),
    )
    vram_rule = RULES["vram-pressure"]

    def series(t: int) -> dict:
        out = vram(t, until=10_000)
        out[INT4.name]["upstream_ttft_p99"] = 0.9 if t >= 60 else 0.3
        return out

    trs, tables, state, _engines = run_offload(
        series, cfg(vram_rule, latency), 120, engines=Engines(wake_s=7)
    )
    actions = [(t.at, t.action, t.engine) for t in trs]
    assert actions[:2] == [(30.0, "limit_concurrency", "omni-int4"), (30.0, "sleep", "omni-bf16")]
    # Latency breaches from 60; due at 65: BF16 is asleep, so the shift waits and BF16 is woken first.
    assert actions[2:] == [
        (65.0, "wake", "omni-bf16"),
        (72.0, "awake", "omni-bf16"),
        (72.0, "shift", "omni-int4"),
    ]
    for t in range(30, 72):
        assert tables[t].weights["omni"]["omni-bf16"] == 0.0, t  # no traffic before the gauge says awake
    assert tables[72].weights["omni"]["omni-bf16"] == pytest.approx(0.95)
    assert state.sleeping == {}


def test_a_sleep_or_wake_the_gauge_does_not_confirm_is_sent_again_after_retry_s():
    rule = RULES["vram-pressure"]

    class Deaf(Engines):
        def apply(self, now, intents):  # the engine never acts on them
            self.sent.extend((now, i) for i in intents)

    _, tables, state, engines = run_offload(vram, cfg(rule, retry_s=20), 100, engines=Deaf())
    assert [(at, i.action) for at, i in engines.sent] == [
        (30.0, "sleep"),
        (50.0, "sleep"),
        (70.0, "sleep"),
        (90.0, "sleep"),
    ]
    # Unconfirmed or not, the engine stays out of routing while the controller means it to sleep.
    assert tables[99].weights["omni"]["omni-bf16"] == 0.0 and "omni-bf16" in state.sleeping


def test_sleep_state_survives_json_and_decide_stays_pure():
    rule = RULES["vram-pressure"]
    a = run_offload(vram, cfg(rule), 60)
    b = run_offload(vram, cfg(rule), 60)
    assert a[0] == b[0] and a[2] == b[2]
    state = a[2]
    assert state.sleeping["omni-bf16"].phase == "asleep"
    again = ControllerState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_a_raise_never_holds_back_a_rollback_it_starts_no_cooldown_and_spends_no_switch_budget():
    shift = Rule(
        name="int4-latency",
        select={"variants": ["int4"]},
        signal="ttft_p99",
        above=0.6,
        for_s=31,
        min_samples=20,
        action=RuleAction(kind="shift", to_variants=["bf16"]),
    )
    config = ControllerSettings(
        rules=[RULES["latency-batch"], shift], min_dwell_s=0, cooldown_s=120, max_switches_per_hour=1
    )
    trs, _tables, state = run_p50(lambda t: 0.9, config, 60, extra={"int4": lambda t: {"ttft_p99": 1.2}})
    assert [(t.at, t.action) for t in trs] == [(30.0, "raise_concurrency"), (31.0, "shift")]
    assert state.switches == (31.0,) and state.last_switch == {"omni": 31.0}


def test_a_sleeping_engine_is_not_even_a_failover_candidate():
    a, b = _engine("a", max_in_flight=1), _engine("b")
    pool = EnginePool([a, b], Metrics(CollectorRegistry()))
    for e in (a, b):
        pool._set_health(e, True)
    assert sorted(e.name for e in pool.candidates("x")) == ["a", "b"]
    pool.set_table(RoutingTable(version=1, weights={"x": {"a": 1.0, "b": 0.0}}, asleep=("b",)))
    assert [e.name for e in pool.candidates("x")] == ["a"]
    assert pool.acquire(a)  # a is full now: still nothing spills over to the sleeping b
    assert [e.name for e in pool.candidates("x")] == ["a"]
    # And the controller's table says who sleeps.
    state = ControllerState.from_dict({"sleeping": {"omni-bf16": {
        "engine": "omni-bf16", "phase": "waking", "by": "vram-pressure@omni-int4", "level": 1, "since": 0.0,
        "sent_at": 0.0}}})  # fmt: skip
    assert table(state).asleep == ("omni-bf16",)
    assert RoutingTable.from_dict(table(state).to_dict()).asleep == ("omni-bf16",)
