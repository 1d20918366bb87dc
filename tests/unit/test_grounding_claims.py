"""Premise, claims, facts and the speech bound of the grounding guard."""

from __future__ import annotations

import pytest

from core.context import RequestContext
from core.events import Delta
from core.schemas import ChatCompletionRequest
from policies.grounding.claims import (
    claims_of,
    date_supported,
    dates_in,
    is_claim,
    language_of,
    names_in,
    numbers_in,
    premise_of,
    split_sentences,
    states,
    weekdays_in,
)
from policies.grounding.policy import GroundingConfig, SpeechGate
from policies.registry import PolicyConfigError, available_plugins, build_chain
from policies.settings import PolicyChainConfig, PolicySpec


def _req(messages: list[dict]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def test_premise_is_system_user_and_tool_text_not_assistant_turns():
    req = _req(
        [
            {"role": "system", "content": "You are helpful."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Doc: Oslo is the capital of Norway."},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ],
            },
            {"role": "assistant", "content": "Bergen is the capital."},
            {"role": "tool", "tool_call_id": "call_1", "content": "Norway has 5.5 million people."},
            {"role": "user", "content": "And its population?"},
        ]
    )
    p = premise_of(req, transcripts=["The caller said it was snowing."], exclude=["You are helpful."])
    assert "Oslo" in p.text and "5.5 million" in p.text and "snowing" in p.text
    assert "Bergen" not in p.text
    assert "You are helpful." not in p.text
    assert next(s.strip() for s in p.sentences) == "Doc: Oslo is the capital of Norway."


def test_premise_chunks_are_sentence_aligned_and_bounded():
    req = _req([{"role": "user", "content": " ".join(f"Sentence number {i} is here." for i in range(50))}])
    chunks = premise_of(req).chunks(200)
    assert len(chunks) > 5
    assert all(len(c) <= 200 for c in chunks)
    assert all(c.endswith(".") for c in chunks)


def test_sentences_keep_their_text():
    text = "Dr. Smith went to Washington on Jan. 3, 2021. He paid $3.50! Then he left"
    parts = split_sentences(text)
    assert "".join(parts) == text
    assert len(parts) == 3


def test_claims_need_words_or_facts_and_are_no_questions():
    assert not is_claim("Sure.")
    assert not is_claim("Shall I tell you more about the tower?")
    assert not is_claim("好的。")
    assert is_claim("It opened in 1889.")
    assert is_claim("The tower was painted brown again recently.")
    assert is_claim("巴黎是法国的首都。")
    assert claims_of(["Sure. ", "It is 330 metres tall."]) == ["It is 330 metres tall."]


def test_evidence_is_what_states_something():
    assert not states("What is the capital of France?")
    assert not states("Tell me about it.")
    assert not states("You are a helpful assistant.")
    assert states("The meeting is on Tuesday.")
    assert states("公司2024年营收为1200万元。")
    assert states("会议定于星期二下午三点在北京举行。")
    assert not _req_premise("What is the capital of France? Tell me about it.").has_evidence
    assert not _req_premise("法国的首都是哪里？").has_evidence
    assert _req_premise("Doc: the meeting is on Tuesday. When is it?").sentences == (
        "Doc: the meeting is on Tuesday. ",
    )


def _req_premise(user: str):
    return premise_of(_req([{"role": "user", "content": user}]))


def test_sentences_split_by_the_script_s_language():
    assert language_of("会议定于星期二。") == "zh" and language_of("It is.") == "en"
    assert language_of("会議は火曜日です。") == "ja"
    text = "会议定于星期二下午三点举行。公司营收为1200万元。你知道吗？好的"
    parts = split_sentences(text)
    assert "".join(parts) == text
    assert parts == ["会议定于星期二下午三点举行。", "公司营收为1200万元。", "你知道吗？", "好的"]


def test_chinese_facts():
    assert numbers_in("公司2024年营收为1200万元。") == {"2024", "1200"}
    assert weekdays_in("会议定于星期二，或周五，或礼拜天。") == {2, 5, 7}
    assert weekdays_in("The meeting moved from Tuesday to friday.") == {2, 5}


def test_numbers_are_normalised():
    assert numbers_in("It cost $1,000.50, about 12% more; 3.0 times; -4") == {"1000.5", "12%", "3", "-4"}
    assert numbers_in("Qwen3 and GPT4 are names") == set()


def test_names_skip_sentence_starts():
    assert names_in("The tower stands in Paris. Completed in 1889, it was built by Gustave Eiffel.") == {
        "paris",
        "gustave",
        "eiffel",
    }
    assert names_in("New York is big.") == {"york"}


def test_dates_keep_only_the_parts_they_state():
    assert dates_in("It opened on 31 March 1889.") == {(1889, 3, 31)}
    assert (None, 3, 31) in dates_in("It opened on March 31.")
    premise = dates_in("It was completed on 31 March 1889.")
    assert date_supported((1889, 3, 31), premise)
    assert date_supported((None, 3, 31), premise)
    assert not date_supported((1889, 5, 31), premise)
    assert not date_supported((1889, 3, 31), {(None, 3, 31)})  # the year is not in the premise


def test_speech_gate_releases_only_what_the_passed_text_accounts_for():
    rate = 24000
    gate = SpeechGate(chars_per_second=30.0)
    for _ in range(5):
        gate.hold(Delta(audio=b"\x00\x01" * int(rate * 0.2), sample_rate=rate))  # 5 x 0.2 s
    out, _ = gate.release(0)
    assert out == []
    out, _ = gate.release(15)  # 15 chars at 30 chars/s: 0.5 s
    assert sum(len(d.audio) for d in out) / (2 * rate) == pytest.approx(0.5)
    assert len(out) == 3 and len(out[-1].audio) == 2 * int(rate * 0.1)  # the third delta was split
    out, _ = gate.release(15)
    assert out == []
    out, _ = gate.release(30)  # 1.0 s in all
    assert sum(len(d.audio) for d in out) / (2 * rate) == pytest.approx(0.5)
    rest, _ = gate.drain()
    assert len(rest) == 0 or sum(len(d.audio) for d in rest) == 0


def test_grounding_config_is_validated_when_the_chain_is_built():
    assert "grounding" in available_plugins()
    with pytest.raises(PolicyConfigError, match=r"policies.post\[0\].config.mode"):
        build_chain(PolicyChainConfig(post=[PolicySpec(name="grounding", config={"mode": "sometimes"})]))
    with pytest.raises(PolicyConfigError, match=r"config.threshold"):
        build_chain(PolicyChainConfig(post=[PolicySpec(name="grounding", config={"threshold": 1.5})]))
    chain = build_chain(
        PolicyChainConfig(
            post=[
                PolicySpec(
                    name="grounding",
                    config={"mode": "window", "modes_by_model": {"rag": "hold"}, "on_exhausted": "refuse"},
                )
            ]
        )
    )
    impl = chain.post[0].impl
    assert isinstance(impl.config, GroundingConfig)
    assert (
        impl.stream_mode(
            _req([{"role": "user", "content": "x"}]).model_copy(update={"model": "rag"}),
            RequestContext.new("r"),
        )
        == "hold"
    )
    assert impl.stream_mode(_req([{"role": "user", "content": "x"}]), RequestContext.new("r")) == "window"


def test_retry_adjustment_lowers_temperature_and_adds_the_instruction_once():
    chain = build_chain(
        PolicyChainConfig(post=[PolicySpec(name="grounding", config={"retry_temperature": 0.2})])
    )
    impl = chain.post[0].impl
    req = _req([{"role": "user", "content": "x"}]).model_copy(update={"temperature": 0.9})
    update = impl.adjust(req)
    assert update["temperature"] == 0.2
    assert update["messages"][0].role == "system"
    again = impl.adjust(req.model_copy(update=update))
    assert "messages" not in again
    cold = impl.adjust(req.model_copy(update={"temperature": 0.1}))
    assert cold["temperature"] == 0.1


async def test_the_policy_takes_the_gateway_scorer_when_started():
    from gateway.services import Services
    from gateway.settings import Settings
    from observability.metrics import Metrics
    from policies.registry import resources_used

    cfg = PolicyChainConfig(post=[PolicySpec(name="grounding")])
    assert resources_used(cfg) == {"scorer"}
    assert resources_used(PolicyChainConfig()) == set()
    services = Services.build(Settings(policies=cfg), Metrics())
    policy = services.chain.post[0].impl
    with pytest.raises(RuntimeError, match="not started"):
        _ = policy.scorer  # the property raises before the scorer is started
    await policy.start(services.deps())  # the lifespan does this after loading the scorer
    assert policy.scorer is services.scorer
    assert Services.build(Settings(), Metrics()).scorer is None
