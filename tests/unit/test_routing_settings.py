"""The ``routing`` configuration: defaults, and bad values that fail the boot naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.settings import Settings

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
    s = Settings(engines=ENGINES)
    assert s.routing.state.backend == "memory" and not s.routing.sentinel.enabled
    assert s.routing.sentinel.sample_share == 0.10
    assert [r.name for r in s.routing.controller.rules] == [
        "int4-latency", "int4-latency-whole", "vram-pressure", "latency-batch", "wer-drift", "canary-errors", "canary-latency",
        "energy-efficiency", "accuracy-floor",
    ]  # fmt: skip
    assert s.routing.controller.rules[0].recover_below == 0.45


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
