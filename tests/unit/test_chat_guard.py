"""A Llama Guard-style answer read as label probabilities (``endpoint: chat-guard``), and its config checks.

The engine is replaced at the HTTP edge (httpx's mock transport) by answers in Llama Guard 3's format:
``safe``, or ``unsafe`` and a line of category codes (``S1,S10``). The real engine's side is
tests/realvllm/test_chat_guard.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from pydantic import ValidationError

from core.errors import GuardUnavailable
from policies.served.client import ServedModel
from policies.settings import ServedModelSettings
from policies.text_screen import TextScreenConfig


def _model(content: str | None, logprob: float | None = None, status: int = 200) -> tuple[ServedModel, list]:
    seen: list = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        logprobs = None if logprob is None else {"content": [{"token": "x", "logprob": logprob}]}
        message = {"role": "assistant", "content": content}
        return httpx.Response(
            status, json={"choices": [{"index": 0, "message": message, "logprobs": logprobs}]}
        )

    settings = ServedModelSettings(url="http://guard:8000", model="llama-guard", endpoint="chat-guard")
    model = ServedModel(settings, name="text-screen")
    model._http = httpx.AsyncClient(base_url="http://guard:8000", transport=httpx.MockTransport(answer))
    return model, seen


def _classify(model: ServedModel, text: str) -> dict[str, float]:
    async def go() -> dict[str, float]:
        try:
            (probs,) = await model.classify([text])
            return probs
        finally:
            await model.aclose()

    return asyncio.run(go())


def test_an_unsafe_answer_names_its_categories_with_the_verdicts_probability():
    model, seen = _model("unsafe\nS1,S10", logprob=math.log(0.9))
    probs = _classify(model, "a threat")
    assert probs["unsafe"] == pytest.approx(0.9) and probs["safe"] == pytest.approx(0.1)
    assert probs["S1"] == pytest.approx(0.9) and probs["S10"] == pytest.approx(0.9)
    body = seen[0]
    # the text itself is the user turn: the guard model's chat template wraps it in its own instructions
    assert body["messages"] == [{"role": "user", "content": "a threat"}]
    assert body["temperature"] == 0.0 and body["logprobs"] is True and "structured_outputs" not in body


def test_a_safe_answer_scores_unsafe_as_the_rest_of_its_probability():
    model, _ = _model("safe", logprob=math.log(0.75))
    probs = _classify(model, "hello")
    assert probs == {"safe": pytest.approx(0.75), "unsafe": pytest.approx(0.25)}


def test_without_logprobs_the_verdict_counts_whole():
    model, _ = _model("unsafe\nS2")
    assert _classify(model, "x")["unsafe"] == 1.0


@pytest.mark.parametrize("content", ["I cannot help with that.", "", None])
def test_an_answer_that_is_no_verdict_means_the_guard_cannot_judge(content):
    model, _ = _model(content, logprob=-0.1)
    with pytest.raises(GuardUnavailable, match="neither safe nor unsafe"):
        _classify(model, "x")


def test_an_engine_error_means_the_guard_cannot_judge():
    model, _ = _model("safe", status=400)
    with pytest.raises(GuardUnavailable, match="HTTP 400"):
        _classify(model, "x")


def test_a_prompt_and_choices_shape_the_call():
    settings = ServedModelSettings(
        url="http://guard:8000",
        model="general",
        endpoint="chat-guard",
        prompt="Judge this: {text}",
        choices=["safe", "unsafe"],
    )
    model, seen = _model("unsafe", logprob=0.0)
    model.settings = settings
    _classify(model, "bad words")
    assert seen[0]["messages"][0]["content"] == "Judge this: bad words"
    assert seen[0]["structured_outputs"] == {"choice": ["safe", "unsafe"]}


def _screen(**served) -> TextScreenConfig:
    return TextScreenConfig.model_validate(
        {
            "served": {"url": "http://guard:8000", "model": "g", "endpoint": "chat-guard", **served},
            "categories": {"violent": {"labels": ["S1"], "threshold": 0.5}},
        }
    )


def test_the_config_checks_what_a_chat_guard_can_name():
    assert _screen(labels=["S1", "S2"]).served.endpoint == "chat-guard"
    with pytest.raises(ValidationError, match="not labels of the model"):
        _screen(labels=["S2"])
    with pytest.raises(ValidationError, match="upper case"):
        _screen(labels=["s1"])
    with pytest.raises(ValidationError, match="write \\{text\\} once"):
        _screen(labels=["S1"], prompt="no placeholder")
    with pytest.raises(ValidationError, match="chat-guard's"):
        ServedModelSettings(url="http://g:1", model="g", endpoint="classify", prompt="{text}")
