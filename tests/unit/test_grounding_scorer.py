"""Grounding scorers on real models: the fallback (packaged MiniLM) and a cross-encoder built and saved here.

No model hub is reachable, so the cross-encoder is a tiny BERT classifier made
in the test (random weights; its classifier bias set so the outcome is known),
saved with ``save_pretrained`` and loaded through the same code path a
configured NLI model takes.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from core.schemas import ChatCompletionRequest
from observability.metrics import Metrics
from policies.grounding.claims import claims_of, premise_of, split_sentences
from policies.grounding.scorer import (
    CrossEncoderScorer,
    FallbackScorer,
    Judgement,
    ScorerLoadError,
    _Batcher,
    build_scorer,
)
from policies.settings import GroundingSettings

pytestmark = pytest.mark.timeout(120)

PREMISE = premise_of(
    ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "system",
                    "content": "The Eiffel Tower in Paris was completed on 31 March 1889. It is 330 metres tall.",
                },
                {"role": "user", "content": "Tell me about the tower."},
            ],
        }
    )
)

LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}


def tiny_cross_encoder(path: Path, bias: tuple[float, ...], labels: dict[int, str] = LABELS) -> Path:
    words = [
        "the",
        "eiffel",
        "tower",
        "in",
        "paris",
        "was",
        "completed",
        "on",
        "31",
        "march",
        "1889",
        "it",
        "is",
        "330",
        "metres",
        "tall",
        "1925",
        ".",
        ",",
    ]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    config = BertConfig(
        vocab_size=len(words) + 5,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=len(labels),
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(bias))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fallback() -> FallbackScorer:
    scorer = FallbackScorer(GroundingSettings())
    scorer.load()
    return scorer


def _judge(scorer, answer: str) -> Judgement:
    return scorer.judge_sync(PREMISE, claims_of(split_sentences(answer)))


# --- cross-encoder ------------------------------------------------------------------------------------


def test_cross_encoder_loads_from_a_local_path_and_reads_the_entailment_column(tmp_path):
    path = tiny_cross_encoder(tmp_path / "entails", (-4.0, 4.0, -4.0))
    scorer = build_scorer(GroundingSettings(model=str(path), max_length=64))
    assert isinstance(scorer, CrossEncoderScorer)
    scorer.load()
    assert scorer.describe()["entailment_label"] == "entailment"
    j = _judge(scorer, "It is 330 metres tall. It was completed in 1889.")
    assert len(j.claims) == 2
    assert j.score > 0.99


def test_cross_encoder_contradiction_scores_low_and_min_aggregates(tmp_path):
    path = tiny_cross_encoder(tmp_path / "contradicts", (4.0, -4.0, -4.0))
    scorer = CrossEncoderScorer(GroundingSettings(model=str(path)))
    scorer.load()
    assert scorer.describe()["contradiction_label"] == "contradiction"
    j = _judge(scorer, "It is 330 metres tall.")
    assert j.score < 0.01
    assert [c.label for c in j.claims] == ["contradicted"]


def test_cross_encoder_neutral_is_unverifiable_unless_a_fact_conflicts(tmp_path):
    path = tiny_cross_encoder(tmp_path / "neutral", (-4.0, -4.0, 4.0))
    scorer = CrossEncoderScorer(GroundingSettings(model=str(path)))
    scorer.load()
    j = _judge(scorer, "It is 330 metres tall. It was completed in 1925.")
    neutral, conflicting = j.claims
    # Neither entailed nor contradicted: not counted.
    assert neutral.label == "unverifiable"
    # Neutral to the model, but it gives the completion a year the evidence states otherwise.
    assert conflicting.label == "contradicted"
    assert "1925" in (conflicting.reason or "") and "1889" in (conflicting.reason or "")
    assert j.score == conflicting.score < 0.8
    only_neutral = _judge(scorer, "It is 330 metres tall.")
    assert only_neutral.score == 1.0 and only_neutral.checked == 0


def test_cross_encoder_entailment_label_by_name_and_index(tmp_path):
    labels = {0: "supported", 1: "unsupported"}
    path = tiny_cross_encoder(tmp_path / "binary", (3.0, -3.0), labels)
    with pytest.raises(ScorerLoadError, match=re.escape("set grounding.entailment_label")):
        CrossEncoderScorer(GroundingSettings(model=str(path))).load()
    by_name = CrossEncoderScorer(GroundingSettings(model=str(path), entailment_label="supported"))
    by_name.load()
    assert _judge(by_name, "It is 330 metres tall.").score > 0.99
    by_index = CrossEncoderScorer(GroundingSettings(model=str(path), entailment_label=1))
    by_index.load()
    (claim,) = _judge(by_index, "It is 330 metres tall.").claims
    # Not entailed, and a two-label model cannot say contradicted: unverifiable, its low score kept.
    assert claim.score < 0.01 and claim.label == "unverifiable"
    with pytest.raises(ScorerLoadError, match="not one of the model's 2 labels"):
        CrossEncoderScorer(GroundingSettings(model=str(path), entailment_label=5)).load()


def test_cross_encoder_bad_path_fails_loading_with_the_field_named(tmp_path):
    with pytest.raises(ScorerLoadError, match=re.escape("grounding.model")):
        CrossEncoderScorer(GroundingSettings(model=str(tmp_path / "missing"))).load()


async def test_cross_encoder_runs_off_the_event_loop_and_batches(tmp_path):
    path = tiny_cross_encoder(tmp_path / "async", (-4.0, 4.0, -4.0))
    metrics = Metrics()
    scorer = CrossEncoderScorer(GroundingSettings(model=str(path), max_wait_ms=50), metrics)
    await scorer.start()
    try:
        results = await asyncio.gather(
            *(scorer.judge(PREMISE, [f"It is {n} metres tall."]) for n in range(6))
        )
    finally:
        await scorer.aclose()
    assert all(r.score > 0.99 for r in results)
    count = metrics.registry.get_sample_value(
        "omnigate_grounding_scorer_seconds_count", {"scorer": "cross-encoder"}
    )
    assert count == 6


# --- batching -----------------------------------------------------------------------------------------


async def test_batcher_gathers_concurrent_jobs_into_one_call():
    calls: list[list[int]] = []

    def run(jobs: list[int]) -> list[int]:
        calls.append(list(jobs))
        return [j * 10 for j in jobs]

    batcher: _Batcher[int, int] = _Batcher(run, lambda j: 1, max_items=4, max_wait_s=0.2, name="t")
    batcher.start()
    try:
        out = await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    finally:
        await batcher.aclose()
    assert out == [0, 10, 20, 30, 40, 50]
    assert [len(c) for c in calls] == [4, 2]


async def test_batcher_reports_model_failures_to_every_waiting_job():
    def run(jobs: list[int]) -> list[int]:
        raise RuntimeError("model broke")

    batcher: _Batcher[int, int] = _Batcher(run, lambda j: 1, max_items=8, max_wait_s=0.05, name="t")
    batcher.start()
    try:
        results = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
    finally:
        await batcher.aclose()
    assert all(isinstance(r, RuntimeError) for r in results)


# --- fallback -----------------------------------------------------------------------------------------


def test_fallback_accepts_a_supported_answer(fallback):
    j = _judge(fallback, "The Eiffel Tower is 330 metres tall and was completed on March 31, 1889.")
    assert j.score >= 0.8


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("The Eiffel Tower was completed in 1925.", "number 1925"),
        ("The Eiffel Tower is 300 metres tall.", "number 300"),
        ("The Eiffel Tower was completed on 31 May 1889.", "date 1889-5-31"),
        ("The Eiffel Tower in Paris was built by the company of Frank Lloyd Wright.", "name 'frank'"),
    ],
)
def test_fallback_contradicts_facts_that_conflict_with_the_evidence(fallback, answer, reason):
    j = _judge(fallback, answer)
    assert j.score == 0.0
    assert j.weakest is not None and j.weakest.label == "contradicted"
    assert reason in (j.weakest.reason or "") and "the evidence says" in (j.weakest.reason or "")


@pytest.mark.parametrize(
    "answer",
    [
        "Paris is the capital of France.",  # a name the evidence never mentions, about something else
        "The Louvre opened in 1793 and is the most visited museum in the world.",
        "Bananas are an excellent source of potassium for athletes.",  # no fact, nothing similar
    ],
)
def test_fallback_a_claim_the_evidence_does_not_bear_on_is_unverifiable_not_failed(fallback, answer):
    j = _judge(fallback, answer)
    assert [c.label for c in j.claims] == ["unverifiable"]
    assert j.score == 1.0 and j.checked == 0 and j.weakest is None


def test_fallback_minimum_over_checked_claims_and_no_claims_pass(fallback):
    mixed = _judge(fallback, "The Eiffel Tower is 330 metres tall. It was completed in 1925.")
    assert [c.label for c in mixed.claims] == ["supported", "contradicted"]
    assert mixed.score == min(c.score for c in mixed.claims) == 0.0
    assert _judge(fallback, "Sure.").score == 1.0
    with_unverifiable = _judge(
        fallback, "The Eiffel Tower is 330 metres tall. Paris is the capital of France."
    )
    assert [c.label for c in with_unverifiable.claims] == ["supported", "unverifiable"]
    assert with_unverifiable.score == with_unverifiable.claims[0].score >= 0.8
    assert with_unverifiable.counts() == {"supported": 1, "contradicted": 0, "unverifiable": 1}


def _premise(doc: str, question: str) -> object:
    return premise_of(
        ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
            }
        )
    )


MEETING = "The board meeting is on Tuesday at 3 pm in Room 4. Revenue in 2025 was 12 million euros."
MEETING_ZH = "董事会会议定于星期二下午三点在北京举行。公司2024年营收为1200万元。"


@pytest.mark.parametrize(
    ("doc", "answer", "labels"),
    [
        (
            MEETING,
            "The meeting is on Tuesday. Revenue in 2025 was 12 million euros.",
            ["supported", "supported"],
        ),
        (MEETING, "The meeting is on Friday.", ["contradicted"]),
        (MEETING, "Revenue in 2025 was 15 million euros.", ["contradicted"]),
        (MEETING, "Paris is the capital of France.", ["unverifiable"]),
        (MEETING_ZH, "会议在星期二举行。公司2024年营收为1200万元。", ["supported", "supported"]),
        (MEETING_ZH, "会议在星期五举行。", ["contradicted"]),
        (MEETING_ZH, "公司2024年营收为1500万元。", ["contradicted"]),
        (MEETING_ZH, "巴黎是法国的首都。", ["unverifiable"]),
    ],
)
def test_fallback_three_way_labels_in_english_and_chinese(fallback, doc, answer, labels):
    j = fallback.judge_sync(_premise(doc, "?"), claims_of(split_sentences(answer)))
    assert [c.label for c in j.claims] == labels, j.claims
    assert (j.score >= 0.8) == ("contradicted" not in labels)


def test_fallback_score_mapping_is_on_the_threshold_scale(fallback):
    floor = fallback.settings.similarity_floor
    assert fallback._map(floor) == pytest.approx(0.8)
    assert fallback._map(1.0) == pytest.approx(1.0)
    assert fallback._map(floor / 2) == pytest.approx(0.4)
    assert fallback._map(-0.3) == 0.0


def test_fallback_with_a_missing_embedding_directory_fails_loading(tmp_path):
    with pytest.raises(ScorerLoadError, match=re.escape("grounding.embedding_model")):
        FallbackScorer(GroundingSettings(embedding_model=str(tmp_path / "nope"))).load()


async def test_a_failing_model_fails_closed_with_guard_unavailable(tmp_path):
    from core.errors import GuardUnavailable

    # The tiny model has 128 positions; allowing 512-token inputs makes a long premise overflow them.
    path = tiny_cross_encoder(tmp_path / "short", (-4.0, 4.0, -4.0))
    scorer = CrossEncoderScorer(GroundingSettings(model=str(path), max_length=512))
    await scorer.start()
    long_premise = premise_of(
        ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "the eiffel tower is 330 metres tall . " * 60}],
            }
        )
    )
    try:
        with pytest.raises(GuardUnavailable) as err:
            await scorer.judge(long_premise, ["It is 330 metres tall."])
        assert err.value.status == 503 and err.value.code == "guard_unavailable"
        # The scorer keeps serving after a failed batch.
        assert (await scorer.judge(PREMISE, ["It is 330 metres tall."])).score > 0.99
    finally:
        await scorer.aclose()


async def test_a_scorer_that_cannot_load_fails_the_gateway_start(tmp_path):
    from gateway.services import Services
    from gateway.settings import Settings
    from policies.settings import PolicyChainConfig, PolicySpec

    settings = Settings(
        policies=PolicyChainConfig(post=[PolicySpec(name="grounding")]),
        grounding={"model": str(tmp_path / "no-such-model")},
    )
    services = Services.build(settings, Metrics())
    assert services.describe_scorer()["kind"] == "cross-encoder"
    with pytest.raises(ScorerLoadError, match=re.escape("grounding.model")):
        await services.start()
    await services.aclose()


@pytest.mark.parametrize(
    ("doc", "answer", "label"),
    [
        # The measure decides: a claim that goes on about other things still conflicts on it.
        (
            "Paris: 18 degrees, light rain.",
            "It is 31 degrees in Paris and Gustave Eiffel built the Louvre.",
            "contradicted",
        ),
        ("Paris: 18 degrees, light rain.", "It is 18 degrees in Paris.", "supported"),
        # The same measure of another subject is no conflict.
        (
            "The Eiffel Tower is 330 metres tall.",
            "The Seine river is 777 metres wide near the city centre.",
            "unverifiable",
        ),
    ],
)
def test_fallback_numbers_of_the_same_measure_conflict_only_about_the_same_subject(
    fallback, doc, answer, label
):
    j = fallback.judge_sync(_premise(doc, "?"), claims_of(split_sentences(answer)))
    assert [c.label for c in j.claims] == [label], j.claims


def test_fallback_a_date_in_a_system_prompt_is_no_evidence_against_history(fallback):
    # The system prompt states a date; an answer about another subject with another year is not about it.
    doc = "You are a helpful assistant. The current date is 5 December 2026."
    j = fallback.judge_sync(
        _premise(doc, "?"), claims_of(split_sentences("The French Revolution began in 1789."))
    )
    assert [c.label for c in j.claims] == ["unverifiable"], j.claims
