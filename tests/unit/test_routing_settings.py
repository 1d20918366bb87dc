"""The ``routing`` configuration: defaults, and bad values that fail the boot naming the field."""

from __future__ import annotations

import pytest
import structlog
from pydantic import ValidationError

from engines.rollout.rules import default_rules
from gateway.settings import Settings

ENGINES = [
    {"name": "a", "kind": "vllm", "base_url": "http://127.0.0.1:9/v1", "model": "m", "serves": ["x"]},
    {"name": "c", "kind": "vllm", "base_url": "http://127.0.0.1:9/v1", "model": "m", "serves": ["x"],
     "role": "canary"},
]  # fmt: skip


def _rule(**over) -> dict:
    rule = {
        "name": "r",
        "signal": "ttft_p99",
        "above": 0.6,
        "action": {"kind": "shift", "to_variants": ["bf16"]},
    }
    return rule | over


def test_defaults_are_one_process_and_the_default_rules():
    assert [r.name for r in default_rules()] == [
        "int4-latency", "int4-latency-whole", "vram-pressure", "latency-batch", "wer-drift", "canary-errors", "canary-latency",
        "energy-efficiency", "accuracy-floor",
    ]  # fmt: skip
    assert default_rules()[0].recover_below == 0.45
    s = Settings(engines=ENGINES)
    assert s.routing.state.backend == "memory" and not s.routing.sentinel.enabled
    assert s.routing.sentinel.sample_share == 0.10
    # Two BF16 engines, one a canary: the INT4, WER and energy rules have nothing to act on here.
    assert [r.name for r in s.routing.controller.rules] == [
        "vram-pressure", "latency-batch", "canary-errors", "canary-latency", "accuracy-floor",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("routing", "engines_over", "named"),
    [
        ({"controller": {"rules": [_rule(), _rule()]}}, None, "rule names must be unique"),
        ({"controller": {"rules": [_rule(recover_below=0.9)]}}, None, "recover_below must not exceed above"),
        ({"controller": {"rules": [_rule(below=0.1)]}}, None, "set exactly one of above and below"),
        ({"accuracy": {"enabled": True}}, None, "needs routing.accuracy.set_path"),
        ({"energy": {"audio_tokens_per_s": -1}}, None, "routing.energy.audio_tokens_per_s"),
        ({"controller": {"rules": [_rule(action={"kind": "shift"})]}}, None, "a shift needs to_variants"),
        ({"controller": {"rules": [_rule(signal="gpu_temp")]}}, None, "routing.controller.rules.0.signal"),
        ({"controller": {"rules": [_rule(name="Bad Name")]}}, None, "routing.controller.rules.0.name"),
        ({"sentinel": {"sample_share": 1.5}}, None, "routing.sentinel.sample_share"),
        ({"state": {"backend": "etcd"}}, None, "routing.state.backend"),
        ({"circuit": {"colour": 1}}, None, "routing.circuit.colour"),
        ({}, {"weight": 0.6}, "add up to more than 1"),
    ],
)
def test_bad_routing_config_names_the_problem(routing, engines_over, named):
    engines = [dict(e) for e in ENGINES]
    if engines_over:
        engines[1] |= engines_over
        engines.append(dict(engines[1], name="c2"))
    with pytest.raises(ValidationError) as err:
        Settings(engines=engines, routing=routing)
    assert named in str(err.value)


# -- rules that can never act ---------------------------------------------------------------------------


def _engine(name: str, variant: str, serves: list[str], role: str = "primary") -> dict:
    return {"name": name, "kind": "vllm", "base_url": "http://127.0.0.1:9/v1", "model": "m",
            "variant": variant, "serves": serves, "role": role}  # fmt: skip


INT4_AND_BF16 = [_engine("q", "int4", ["x"]), _engine("b", "bf16", ["x"])]


def _shift(name: str, to: list[str], **select) -> dict:
    return _rule(name=name, select=select, action={"kind": "shift", "to_variants": to})


def _refusal(engines: list[dict], rules: list[dict]) -> str:
    with pytest.raises(ValidationError) as err:
        Settings(engines=engines, routing={"controller": {"rules": rules}})
    return str(err.value)


def test_an_explicit_shift_to_a_variant_no_engine_has_is_refused_naming_rule_and_variant():
    msg = _refusal(INT4_AND_BF16, [_shift("wer-drift", ["int8"], variants=["int4"])])
    assert "routing.controller.rules[0] wer-drift" in msg and "shifts to int8" in msg
    assert "x is served by q (int4), b (bf16)" in msg


def test_a_target_variant_that_serves_another_model_is_no_target():
    # The BF16 engine exists, but serves y: the INT4 engine's traffic (x) has nowhere to go.
    engines = [_engine("q", "int4", ["x"]), _engine("b", "bf16", ["y"])]
    msg = _refusal(engines, [_shift("int4-latency", ["fp16", "bf16"], variants=["int4"])])
    assert "int4-latency" in msg and "shifts to fp16, bf16" in msg


def test_an_engine_is_no_target_of_its_own_shift():
    msg = _refusal([_engine("b", "bf16", ["x"])], [_shift("to-bf16", ["bf16"])])
    assert "to-bf16" in msg and "shifts to bf16" in msg


@pytest.mark.parametrize(
    "select",
    [
        {"roles": ["canary"]},
        {"variants": ["int8"]},
        {"engines": ["nope"]},
        {"variants": ["int4"], "roles": ["fallback"]},
    ],
)
def test_an_explicit_rule_whose_selector_matches_no_engine_is_refused(select):
    rule = _rule(name="watch", select=select, action={"kind": "set_weight", "weight": 0})
    msg = _refusal(INT4_AND_BF16, [rule])
    assert "routing.controller.rules[0] watch: watches no engine" in msg
    assert "q (int4, primary), b (bf16, primary)" in msg


def test_explicit_rules_that_can_act_are_kept_as_written():
    rules = [
        _shift("wer-drift", ["int8", "bf16"], variants=["int4"]),  # int8 is absent, bf16 takes it
        _shift("any-to-bf16", ["bf16"]),  # watches both; only the INT4 engine has somewhere to go
        _rule(name="vram", signal="vram_usage", above=0.9, action={"kind": "limit_concurrency"}),
    ]
    s = Settings(engines=INT4_AND_BF16, routing={"controller": {"rules": rules}})
    assert [r.name for r in s.routing.controller.rules] == ["wer-drift", "any-to-bf16", "vram"]
    assert (
        Settings(engines=INT4_AND_BF16, routing={"controller": {"rules": []}}).routing.controller.rules == []
    )


def _defaults(engines: list[dict] | None) -> tuple[list[str], dict[str, str]]:
    with structlog.testing.capture_logs() as logs:
        s = Settings(engines=engines) if engines is not None else Settings()
    left = [e for e in logs if e["event"] == "rollback_rules_inactive"]
    assert len(left) <= 1
    return [r.name for r in s.routing.controller.rules], (left[0]["rules"] if left else {})


def test_the_default_rules_that_cannot_act_are_left_out_and_logged():
    # One INT4 engine: nothing to roll it back to, no canary, no other variant to prefer INT4 over.
    kept, left = _defaults([_engine("q", "int4", ["x"])])
    assert kept == ["vram-pressure", "latency-batch", "accuracy-floor"]
    assert sorted(left) == sorted(
        [
            "int4-latency",
            "int4-latency-whole",
            "wer-drift",
            "canary-errors",
            "canary-latency",
            "energy-efficiency",
        ]
    )
    assert left["wer-drift"].startswith("shifts to int8, fp16, bf16")
    assert left["canary-errors"].startswith("watches no engine")


def test_the_embedded_default_keeps_the_rules_it_can_act_on():
    kept, left = _defaults(None)
    assert kept == ["vram-pressure", "latency-batch", "accuracy-floor"]
    assert "energy-efficiency" in left  # FP32 with no INT4 to prefer


def test_a_layout_with_every_target_keeps_every_default_rule():
    engines = [*INT4_AND_BF16, _engine("c", "int4", ["x"], role="canary")]
    kept, left = _defaults(engines)
    assert [r.name for r in default_rules()] == kept and left == {}
    # INT4 with BF16, no canary: only the canary rules go.
    kept, left = _defaults(INT4_AND_BF16)
    assert sorted(left) == ["canary-errors", "canary-latency"]
    assert "wer-drift" in kept and "energy-efficiency" in kept
