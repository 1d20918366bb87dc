"""The WER sentinel scores only speech in a language its ASR model hears (tiny.en: English); the rest is unscored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from core.events import Completion
from engines.rollout.language import detect
from engines.rollout.sentinel import AccuracySentinel, WerScorer
from engines.rollout.settings import SentinelSettings
from observability.metrics import Metrics
from tests.speech import PAIRS, read_pcm, speech_set

pytestmark = pytest.mark.timeout(180)

CHINESE = [
    "您好，请问有什么可以帮您？我们的客服代表马上为您服务。",
    "您的订单已经发货，预计明天下午送达，请注意查收。",
    "很抱歉给您带来不便，我们会尽快为您处理退款。",
]


@pytest.mark.parametrize("said", [s for pair in PAIRS for s in pair])
def test_plain_english_is_english(said):
    assert detect(said).language == "en"


@pytest.mark.parametrize(
    ("text", "language", "script"),
    [
        (CHINESE[0], "zh", "han"),
        ("お問い合わせありがとうございます。担当者がすぐに対応します。", "ja", "kana"),
        ("문의해 주셔서 감사합니다. 곧 상담원이 연결됩니다.", "ko", "hangul"),
        ("Спасибо за ваш звонок, оператор скоро ответит.", None, "cyrillic"),  # one script, several languages
        ("Por favor envíe el informe al equipo de finanzas antes del viernes.", None, "latin"),
        ("Merci pour votre patience, nous allons vous aider rapidement.", None, "latin"),
        ("Bitte senden Sie den Bericht vor Freitag an die Finanzabteilung.", None, "latin"),
        ("12 34 56", None, "none"),
        # A name in another script inside an English sentence is still English.
        ("Please call Mr 王 at the office before noon tomorrow.", "en", "latin"),
    ],
)
def test_other_languages_are_told_apart_or_left_undetermined(text, language, script):
    assert detect(text) == type(detect(text))(language, script)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    return speech_set(tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="module")
def scorer():
    return WerScorer()


def _unscored(registry: CollectorRegistry, engine: str, reason: str) -> float:
    labels = {"engine": engine, "reason": reason}
    return registry.get_sample_value("omnigate_sentinel_unscored_total", labels) or 0.0


async def _sentinel(registry: CollectorRegistry, scorer, **settings) -> AccuracySentinel:
    s = SentinelSettings(enabled=True, sample_share=1.0, queue_size=64, min_words=3, **settings)
    sentinel = AccuracySentinel(s, Metrics(registry), seed=3, scorer=scorer)
    await sentinel.start()
    return sentinel


async def test_chinese_speech_is_counted_unscored_never_as_word_errors(speech, scorer):
    registry = CollectorRegistry()
    sentinel = await _sentinel(registry, scorer)
    try:
        # The audio does not say the transcript (the English listener would score it all wrong): not scored.
        _, own, _ = speech[0]
        pcm, rate = read_pcm(own)
        for text in CHINESE * 5:
            assert not sentinel.offer("omni-int4", "int4", Completion(text=text, audio=pcm, sample_rate=rate))
        await asyncio.wait_for(sentinel.drain(), 60)
        assert sentinel.totals("omni-int4") == (
            0,
            0,
            0,
        )  # no WER signal: the wer-drift rule has nothing to act on
        assert _unscored(registry, "omni-int4", "language-detected") == 15
        scored = registry.get_sample_value(
            "omnigate_sentinel_samples_total", {"engine": "omni-int4", "outcome": "scored"}
        )
        assert not scored
        # English speech on the same engine is scored as before.
        said, own, _ = speech[1]
        pcm, rate = read_pcm(own)
        assert sentinel.offer("omni-int4", "int4", Completion(text=said, audio=pcm, sample_rate=rate))
        await asyncio.wait_for(sentinel.drain(), 60)
        assert sentinel.totals("omni-int4") == (0, 11, 1)
    finally:
        await sentinel.aclose()


async def test_the_configured_language_comes_first_tenant_then_model_then_deployment(speech, scorer):
    registry = CollectorRegistry()
    sentinel = await _sentinel(
        registry,
        scorer,
        tenant_languages={"acme-cn": "zh"},
        model_languages={"omni-cn": "zh", "omni": "en"},
    )
    said, own, _ = speech[0]
    pcm, rate = read_pcm(own)
    english = Completion(text=said, audio=pcm, sample_rate=rate)
    try:
        # An English-looking transcript for a tenant configured as Chinese: the configuration wins.
        assert not sentinel.offer("e", "int4", english, model="omni", tenant="acme-cn")
        assert not sentinel.offer("e", "int4", english, model="omni-cn", tenant="other")
        assert _unscored(registry, "e", "language-config") == 2
        assert sentinel.offer("e", "int4", english, model="omni", tenant="other")
        assert sentinel.language_of(CHINESE[0], "omni", None) == ("en", "config")
        assert sentinel.language_of(CHINESE[0], None, None) == ("zh", "detected")
        await asyncio.wait_for(sentinel.drain(), 60)
    finally:
        await sentinel.aclose()
    registry = CollectorRegistry()
    sentinel = await _sentinel(registry, scorer, default_language="zh")
    try:
        assert not sentinel.offer("e", "int4", english)
        assert _unscored(registry, "e", "language-config") == 1
    finally:
        await sentinel.aclose()
    # A multilingual model can cover more languages; an unknown tag is refused at boot.
    assert SentinelSettings(languages=["en", "zh"]).languages == ["en", "zh"]
    with pytest.raises(ValueError):
        SentinelSettings(default_language="Chinese")


def test_the_example_deployment_turns_the_sentinel_on_for_english():
    import yaml

    from gateway.settings import Settings

    path = Path(__file__).resolve().parents[2] / "ops" / "config" / "omnigate.yaml"
    routing = Settings(**yaml.safe_load(path.read_text())).routing
    assert routing.sentinel.enabled and routing.sentinel.languages == ["en"]
    assert routing.sentinel.default_language is None  # decided per transcript unless the operator says
