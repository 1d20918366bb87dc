"""The held-out set replayed by a running gateway: INT8 answers it wrong, so INT4's roll-back lands on BF16."""

from __future__ import annotations

import orjson
import pytest

from engines.rollout.rules import Rule, RuleAction, RuleSelector, default_rules
from engines.rollout.settings import AccuracySettings
from tests.harness import GatewayServer, wait_until
from tests.http.rollout_helpers import Trio, admin, chat, engines, settings
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

LATENCY = Rule(
    name="int4-latency",
    select=RuleSelector(variants=["int4"]),
    signal="upstream_ttft_p99",
    above=0.3,
    for_s=0.3,
    min_samples=5,
    action=RuleAction(kind="shift", to_variants=["int8", "bf16"], trickle_weight=0.05),
)
FLOOR = next(r for r in default_rules() if r.name == "accuracy-floor").model_copy(update={"min_samples": 5})


@pytest.fixture
def trio(bg):
    t = Trio(bg)
    yield t
    t.stop()


def test_an_engine_under_the_floor_is_skipped_as_the_roll_back_target(bg, trio, tmp_path):
    held_out = tmp_path / "held-out.jsonl"
    rows = [{"prompt": f"Question {i}", "choices": ["no", "yes"], "answer": "B"} for i in range(6)]
    held_out.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    trio.set(trio.int4, default=Script(flavour="omni", text="B"))
    trio.set(trio.int8, default=Script(flavour="omni", text="A"))  # wrong on every item
    trio.set(trio.bf16, default=Script(flavour="omni", text="B"))
    cfg = settings(engines(trio), [LATENCY, FLOOR], window_s=5.0)
    cfg.routing.accuracy = AccuracySettings(enabled=True, set_path=str(held_out), interval_s=600)
    server = GatewayServer(bg, cfg).start()
    try:

        def accuracies() -> dict:
            st = admin(server.url, "").json()
            return {e["name"]: e["signals"].get("accuracy") for e in st["engines"]}

        assert wait_until(lambda: None not in accuracies().values(), timeout=30, interval=0.2)
        assert accuracies() == {"omni-int4": 1.0, "omni-int8": 0.0, "omni-bf16": 1.0}
        gauge = server.registry.get_sample_value(
            "omnigate_engine_accuracy_ratio", {"engine": "omni-int8", "variant": "int8"}
        )
        assert gauge == 0.0
        replayed = trio.counts()
        assert replayed == {"int4": 6, "int8": 6, "bf16": 6}

        trio.set(trio.int4, default=Script(flavour="omni", text="B", first_byte_delay_s=0.5))

        def shifted() -> list:
            chat(server.url)
            st = admin(server.url, "").json()
            return [t for t in st["recent_transitions"] if t["action"] == "shift"]

        assert wait_until(lambda: bool(shifted()), timeout=40, interval=0.05)
        t = shifted()[0]
        assert t["reason"] == "int4-latency"
        assert t["detail"]["targets"] == {"omni": ["omni-bf16"]}
        # The transition queued a replay of the engines serving the model.
        assert wait_until(lambda: trio.counts()["int8"] >= 12, timeout=30, interval=0.2)
    finally:
        server.stop()
