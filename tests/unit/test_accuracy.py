"""The held-out accuracy sentinel: a set the test writes, scored exactly, replayed over real sockets, and its rule."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import orjson
import pytest
import soundfile as sf
from PIL import Image
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from engines.rollout.accuracy import (
    HeldOutItem,
    HeldOutSentinel,
    HeldOutSetError,
    choice_letter,
    is_correct,
    load_set,
)
from engines.rollout.rollback import ControllerState, decide
from engines.rollout.routing import EngineInfo
from engines.rollout.rules import Rule, RuleAction, default_rules
from engines.rollout.settings import AccuracySettings, ControllerSettings
from engines.rollout.snapshot import EngineSignals, Snapshot
from engines.selection.pool import build_engine
from observability.metrics import Metrics
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(60)

FLOOR = next(r for r in default_rules() if r.name == "accuracy-floor")
WER = next(r for r in default_rules() if r.name == "wer-drift")


@pytest.mark.parametrize(
    "answer, letter",
    [("B", "B"), ("b", "B"), ("(B)", "B"), ("B.", "B"), ("B) lung", "B"), ("[C]", "C"), ("  d\n", "D"),
     ("The answer is C.", "C"), ("Answer: (A)", "A"), ("answer - b", "B"),
     ("Because", None), ("", None), ("E", None), ("I think so", None)],
)  # fmt: skip
def test_the_choice_letter_is_read_as_graders_normalise_it(answer, letter):
    assert choice_letter(answer, 4) == letter


def test_multiple_choice_is_scored_by_letter_and_open_answers_by_the_exact_string():
    mc = HeldOutItem(prompt="q", answer="B", choices=("heart", "lung"))
    assert is_correct(mc, "B") and is_correct(mc, "(b) lung") and not is_correct(mc, "A")
    assert not is_correct(mc, "lung")  # the letter is the answer, not the choice's text
    open_ = HeldOutItem(prompt="q", answer="Paris")
    assert (
        is_correct(open_, "paris")
        and is_correct(open_, "  Paris.  ")
        and not is_correct(open_, "Paris, France")
    )


def test_the_prompt_lists_the_choices_by_letter_after_the_media():
    item = HeldOutItem(prompt="Which organ?", answer="B", choices=("heart", "lung"),
                       media=({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},))  # fmt: skip
    parts = item.message_content()
    assert parts[0]["type"] == "image_url"
    assert parts[1] == {"type": "text",
                        "text": "Which organ?\nA. heart\nB. lung\nAnswer with the letter of the correct choice only."}  # fmt: skip


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(1600, dtype=np.int16), 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def write_set(folder, rows) -> str:
    path = folder / "held-out.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return str(path)


def test_a_set_loads_media_from_paths_relative_to_it_and_from_data_uris(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "organ.png").write_bytes(_png())
    (tmp_path / "media" / "tone.wav").write_bytes(_wav())
    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    path = write_set(tmp_path, [
        {"prompt": "Which organ?", "media": ["media/organ.png"], "choices": ["heart", "lung"], "answer": "b"},
        {"prompt": "What is heard?", "media": "media/tone.wav", "answer": "silence"},
        {"prompt": "Colour?", "media": [uri], "answer": "red"},
    ])  # fmt: skip
    items = load_set(path)
    assert [i.answer for i in items] == ["B", "silence", "red"]
    assert (
        items[0].media[0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(_png()).decode()
    )
    assert items[1].media[0] == {"type": "input_audio",
                                 "input_audio": {"data": base64.b64encode(_wav()).decode(), "format": "wav"}}  # fmt: skip
    assert items[2].media[0]["image_url"]["url"] == uri


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "q", "media": ["../secret.png"], "answer": "x"}, "not inside the set's folder"),
        ({"prompt": "q", "media": ["/etc/passwd"], "answer": "x"}, "not inside the set's folder"),
        ({"prompt": "q", "media": ["missing.png"], "answer": "x"}, "not found"),
        (
            {"prompt": "q", "media": ["data:text/plain;base64,aGk="], "answer": "x"},
            "not an image, audio or video",
        ),
        ({"prompt": "q", "choices": ["a", "b"], "answer": "C"}, "one of the letters A..B"),
        ({"prompt": "", "answer": "x"}, "prompt must be"),
        ({"prompt": "q"}, "answer must be"),
        ({"prompt": "q", "answer": "x", "expected": "y"}, "unknown fields"),
    ],
)
def test_a_bad_line_is_refused_with_its_line_number(tmp_path, row, message):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "set.jsonl"
    path.write_bytes(orjson.dumps({"prompt": "fine", "answer": "ok"}) + b"\n" + orjson.dumps(row) + b"\n")
    with pytest.raises(HeldOutSetError, match=message) as err:
        load_set(path)
    assert "set.jsonl line 2" in str(err.value)


def test_the_set_has_a_size_limit_and_cannot_be_empty(tmp_path):
    with pytest.raises(HeldOutSetError, match="more than 2 items"):
        load_set(write_set(tmp_path, [{"prompt": "q", "answer": "a"}] * 3), max_items=2)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(HeldOutSetError, match="no items"):
        load_set(tmp_path / "empty.jsonl")


def test_enabling_the_sentinel_needs_a_set():
    with pytest.raises(ValueError, match=re.escape("needs routing.accuracy.set_path")):
        AccuracySettings(enabled=True)


# -- replayed against the scripted upstream, through the real engine adapter ---------------------------------


async def test_a_replay_asks_every_item_and_scores_the_scripted_choices(tmp_path):
    rows = [
        {"prompt": f"Question {i}?", "choices": ["w", "x", "y", "z"], "answer": "ABCD"[i % 4]}
        for i in range(10)
    ]
    items = load_set(write_set(tmp_path, rows))
    metrics = Metrics(CollectorRegistry())
    async with ScriptedUpstream(Script(flavour="vllm"), record=True) as up:
        engine = build_engine(EngineConfig(name="omni-int8", kind="vllm", base_url=up.base_url, model="q-w8",
                                           variant="int8", serves=["omni"]))  # fmt: skip
        await engine.start()
        try:
            # Eight right (two in a grader's other spellings), one wrong, one engine error.
            answers = ["A", "(B)", "C.", "The answer is D", "A", "B", "C", "D"]
            up.enqueue(*(Script(flavour="vllm", text=a) for a in answers),
                       Script(flavour="vllm", text="D"), Script(flavour="vllm", fault="500_before_headers"))  # fmt: skip
            sentinel = HeldOutSentinel(
                AccuracySettings(), lambda: {"omni-int8": engine}, metrics, items=items
            )
            result = await sentinel.replay("omni-int8")
        finally:
            await engine.aclose()
        asked = [r["messages"][0]["content"][-1]["text"].split("\n")[0] for r in up.requests]
    assert result is not None
    assert (result.correct, result.scored, result.failed) == (8, 9, 1)
    assert result.accuracy == pytest.approx(8 / 9)
    assert asked == [f"Question {i}?" for i in range(10)]
    assert sentinel.latest("omni-int8") == (pytest.approx(8 / 9), 9)
    gauge = metrics.registry.get_sample_value("omnigate_engine_accuracy_ratio",
                                              {"engine": "omni-int8", "variant": "int8"})  # fmt: skip
    assert gauge == pytest.approx(8 / 9)


async def test_an_engine_that_only_fails_gets_no_figure_and_waits_its_interval(tmp_path):
    items = load_set(write_set(tmp_path, [{"prompt": "q", "answer": "a"}] * 3))
    now = [1000.0]
    async with ScriptedUpstream(Script(flavour="vllm", fault="500_before_headers")) as up:
        engine = build_engine(EngineConfig(name="down", kind="vllm", base_url=up.base_url, model="q",
                                           variant="int8", serves=["omni"]))  # fmt: skip
        await engine.start()
        try:
            s = HeldOutSentinel(AccuracySettings(interval_s=600), lambda: {"down": engine},
                                Metrics(CollectorRegistry()), items=items, clock=lambda: now[0])  # fmt: skip
            assert s._due() == ["down"]
            result = await s.replay("down")
        finally:
            await engine.aclose()
    assert result is not None and (result.scored, result.failed) == (0, 3) and result.accuracy is None
    assert s.latest("down") is None  # unknown, so the floor neither holds nor clears it
    assert s._due() == []
    now[0] += 600
    assert s._due() == ["down"]


async def test_a_transition_queues_a_replay_of_the_engines_it_touched():
    class _Cfg:
        def __init__(self, serves):
            self.serves = serves

    class _E:
        def __init__(self, serves):
            self.config = _Cfg(serves)

    from engines.rollout.rollback import Transition

    engines = {"a": _E(["omni"]), "b": _E(["omni"]), "c": _E(["other"])}
    s = HeldOutSentinel(AccuracySettings(), lambda: engines, Metrics(CollectorRegistry()), items=[])
    s.on_transition(Transition(at=0, action="shift", reason="int4-latency", source="auto", engine="a",
                               models=("omni",)))  # fmt: skip
    assert s._pending == {"a", "b"}
    off = HeldOutSentinel(
        AccuracySettings(on_transition=False), lambda: engines, Metrics(CollectorRegistry()), items=[]
    )
    off.on_transition(
        Transition(at=0, action="shift", reason="x", source="auto", engine="a", models=("omni",))
    )
    assert off._pending == set()


# -- the rule: a variant under 90 % is no destination -------------------------------------------------------

INT4 = EngineInfo("omni-int4", "int4", "primary", ("omni",))
INT8 = EngineInfo("omni-int8", "int8", "fallback", ("omni",))
BF16 = EngineInfo("omni-bf16", "bf16", "fallback", ("omni",))


def tick(values, state, config, now, accuracy_items=20):
    def samples(name):
        return {k: accuracy_items if k == "accuracy" else 20 for k in values.get(name, {})}

    engines = {i.name: EngineSignals(info=i, values=values.get(i.name, {}), samples=samples(i.name))
               for i in (INT4, INT8, BF16)}  # fmt: skip
    return decide(Snapshot(now=now, engines=engines), state, config)


def cfg(*rules: Rule) -> ControllerSettings:
    return ControllerSettings(rules=list(rules), min_dwell_s=0, cooldown_s=0, max_switches_per_hour=100)


def test_the_default_floor_is_90_percent_and_only_excludes_targets():
    assert FLOOR.signal == "accuracy" and FLOOR.below == 0.9 and FLOOR.action.kind == "exclude_target"


def test_wer_drift_skips_an_int8_under_90_percent_and_goes_to_bf16():
    values = {"omni-int4": {"wer": 0.2}, "omni-int8": {"accuracy": 0.8}, "omni-bf16": {"accuracy": 0.95}}
    d = tick(values, ControllerState(), cfg(WER, FLOOR), 0.0)
    assert [(t.action, t.reason) for t in d.transitions] == [("shift", "wer-drift")]
    assert d.transitions[0].detail["targets"] == {"omni": ["omni-bf16"]}


def test_with_int8_at_90_percent_or_more_wer_drift_goes_to_int8_as_before():
    values = {"omni-int4": {"wer": 0.2}, "omni-int8": {"accuracy": 0.9}}
    d = tick(values, ControllerState(), cfg(WER, FLOOR), 0.0)
    assert d.transitions[0].detail["targets"] == {"omni": ["omni-int8"]}


def test_a_floor_resting_on_too_few_items_does_not_exclude():
    values = {"omni-int4": {"wer": 0.2}, "omni-int8": {"accuracy": 0.5}}
    d = tick(values, ControllerState(), cfg(WER, FLOOR), 0.0, accuracy_items=5)  # min_samples 10
    assert d.transitions[0].detail["targets"] == {"omni": ["omni-int8"]}


def test_no_target_left_above_the_floor_holds_the_shift():
    values = {"omni-int4": {"wer": 0.2}, "omni-int8": {"accuracy": 0.6}, "omni-bf16": {"accuracy": 0.7}}
    d = tick(values, ControllerState(), cfg(WER, FLOOR), 0.0)
    assert d.transitions == ()
    assert [(h.key, h.reason) for h in d.holds] == [("wer-drift@omni-int4", "no-target")]
    # Once BF16 scores 92 % it is a destination again.
    values["omni-bf16"]["accuracy"] = 0.92
    d = tick(values, d.state, cfg(WER, FLOOR), 1.0)
    assert d.transitions[0].detail["targets"] == {"omni": ["omni-bf16"]}


def test_an_exclude_rule_makes_no_incident_of_its_own():
    rule = Rule(name="floor", signal="accuracy", below=0.9, min_samples=1, for_s=0,
                action=RuleAction(kind="exclude_target"))  # fmt: skip
    d = tick({"omni-int8": {"accuracy": 0.1}}, ControllerState(), cfg(rule), 0.0)
    assert d.transitions == () and d.state.incidents == {} and d.state.breaches == {}
