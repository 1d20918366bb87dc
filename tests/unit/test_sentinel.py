"""The accuracy sentinel on real speech: espeak-ng speaks, whisper tiny.en listens, jiwer scores."""

from __future__ import annotations

import asyncio

import jiwer
import pytest
from prometheus_client import CollectorRegistry

from core.events import Completion
from engines.rollout.sentinel import AccuracySentinel, WerScorer
from engines.rollout.settings import SentinelSettings
from observability.metrics import Metrics
from tests.speech import read_pcm, speech_set

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    return speech_set(tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="module")
def scorer():
    return WerScorer()


def test_matching_speech_scores_zero_after_normalising_numbers_and_case(speech, scorer):
    said, own, _ = speech[2]  # "We need twenty five chairs ..."
    pcm, rate = read_pcm(own)
    score = scorer.score(said, pcm, rate)
    assert score is not None and score.errors == 0 and score.words == 9  # "25" is one word
    # Whisper writes the number as digits: without normalisation the same speech would count as errors.
    assert "25" in score.heard
    assert jiwer.wer(said.lower(), score.heard.lower()) > 0
    for said, own, _ in speech[:2]:
        pcm, rate = read_pcm(own)
        assert scorer.score(said, pcm, rate).errors == 0


def test_speech_that_says_something_else_scores_its_word_errors(speech, scorer):
    said, _, drifted = speech[0]
    pcm, rate = read_pcm(drifted)
    score = scorer.score(said, pcm, rate)
    assert score.words == 10 and score.errors == 4  # report, finance, team, friday
    assert score.wer == pytest.approx(0.4)
    assert scorer.score("", pcm, rate) is None


async def test_sentinel_samples_its_share_and_keeps_a_corpus_wer_per_engine(speech, scorer):
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    sentinel = AccuracySentinel(
        SentinelSettings(enabled=True, sample_share=0.1, queue_size=64, min_words=3),
        metrics,
        seed=11,
        scorer=scorer,
    )
    await sentinel.start()
    try:
        # Too short to score: counts how many of 1000 answers were sampled, without transcribing any.
        tiny = Completion(text="ok", audio=b"\0\0" * 100, sample_rate=16000)
        taken = sum(sentinel.offer("e", "int4", tiny) for _ in range(1000))
        skipped = registry.get_sample_value(
            "omnigate_sentinel_samples_total", {"engine": "e", "outcome": "skipped"}
        )
        assert taken == 0 and 70 <= skipped <= 130

        sentinel.settings = sentinel.settings.model_copy(update={"sample_share": 1.0})
        for said, own, drifted in speech[:2]:
            for engine, wav in (("good", own), ("bad", drifted)):
                pcm, rate = read_pcm(wav)
                assert sentinel.offer(engine, "int4", Completion(text=said, audio=pcm, sample_rate=rate))
        await asyncio.wait_for(sentinel.drain(), 120)
        assert sentinel.totals("good") == (0, 21, 2)
        errors, words, samples = sentinel.totals("bad")
        assert samples == 2 and words == 21 and errors >= 6
        assert (
            registry.get_sample_value(
                "omnigate_sentinel_samples_total", {"engine": "bad", "outcome": "scored"}
            )
            == 2
        )
        assert (
            registry.get_sample_value("omnigate_sentinel_wer_count", {"engine": "good", "variant": "int4"})
            == 2
        )
    finally:
        await sentinel.aclose()


async def test_a_full_queue_drops_samples_instead_of_waiting(speech, scorer):
    registry = CollectorRegistry()
    sentinel = AccuracySentinel(
        SentinelSettings(enabled=True, sample_share=1.0, queue_size=1), Metrics(registry), scorer=scorer
    )
    await sentinel.start()
    try:
        said, own, _ = speech[0]
        pcm, rate = read_pcm(own)
        c = Completion(text=said, audio=pcm, sample_rate=rate)
        results = [
            sentinel.offer("e", "int4", c) for _ in range(5)
        ]  # no await between: the worker cannot take any
        assert results == [True, False, False, False, False]
        assert (
            registry.get_sample_value(
                "omnigate_sentinel_samples_total", {"engine": "e", "outcome": "dropped"}
            )
            == 4
        )
        await asyncio.wait_for(sentinel.drain(), 60)
    finally:
        await sentinel.aclose()
