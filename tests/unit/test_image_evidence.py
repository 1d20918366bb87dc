"""The grounding guard's image check: one engine call per answer with the request's images and the open
claims, a constrained JSON answer read strictly, and verdicts cached per (images, claim)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from core.errors import GuardUnavailable
from core.events import Completion
from core.schemas import ChatCompletionRequest
from policies.grounding.image_evidence import ImageEvidence, ImageEvidenceConfig

RED = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
BLUE = RED.replace("X8jx0g", "X8jx0h")


class FakeChat:
    """An engine that answers the check with the verdicts it is given, and keeps what it was asked."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked: list[ChatCompletionRequest] = []

    async def __call__(self, request: ChatCompletionRequest, *, timeout_s: float) -> Completion:
        self.asked.append(request)
        return Completion(text=self.answers.pop(0))


def _request(*images: str, model: str = "omni") -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    parts.append({"type": "text", "text": "What is in the picture?"})
    return ChatCompletionRequest.model_validate(
        {"model": model, "messages": [{"role": "user", "content": parts}]}
    )


def _verdicts(*labels: str) -> str:
    return orjson.dumps({"verdicts": list(labels)}).decode()


def run(coro):
    return asyncio.run(coro)


def test_one_call_asks_about_every_open_claim_with_the_request_s_images():
    chat = FakeChat(_verdicts("supported", "contradicted"))
    check = ImageEvidence(ImageEvidenceConfig(), chat)
    seen = run(check.check(_request(RED, BLUE), ["The apple is red.", "There are three apples."]))
    assert seen is not None and seen.labels == ("supported", "contradicted")
    assert (seen.images, seen.of_images, seen.asked) == (2, 2, 2)
    (asked,) = chat.asked
    assert asked.model == "omni" and asked.temperature == 0
    user = asked.messages[-1]
    kinds = [p.type for p in user.content]
    assert kinds == ["image_url", "image_url", "text"]
    assert [p.image_url.url for p in user.content[:2]] == [RED, BLUE]
    assert "1. The apple is red.\n2. There are three apples." in user.content[2].text
    schema = asked.response_format.model_dump(by_alias=True)["json_schema"]["schema"]["properties"][
        "verdicts"
    ]
    assert schema["minItems"] == schema["maxItems"] == 2


def test_verdicts_are_cached_per_images_and_claim():
    chat = FakeChat(_verdicts("contradicted"), _verdicts("supported"), _verdicts("unverifiable"))
    check = ImageEvidence(ImageEvidenceConfig(), chat)
    first = run(check.check(_request(RED), ["The apple is green."]))
    again = run(check.check(_request(RED), ["The apple is green."]))
    assert first.labels == again.labels == ("contradicted",) and again.asked == 0 and len(chat.asked) == 1
    # another claim about the same image: only it is asked
    mixed = run(check.check(_request(RED), ["The apple is green.", "It sits on a table."]))
    assert mixed.labels == ("contradicted", "supported") and mixed.asked == 1
    assert "1. It sits on a table." in chat.asked[-1].messages[-1].content[-1].text
    # the same claim about another image is another question
    other = run(check.check(_request(BLUE), ["The apple is green."]))
    assert other.labels == ("unverifiable",) and other.asked == 1


def test_no_images_no_question():
    chat = FakeChat()
    check = ImageEvidence(ImageEvidenceConfig(), chat)
    text_only = ChatCompletionRequest.model_validate(
        {"model": "omni", "messages": [{"role": "user", "content": "hello"}]}
    )
    assert run(check.check(text_only, ["Paris is the capital of France."])) is None
    assert chat.asked == []


@pytest.mark.parametrize(
    "answer",
    [
        "not json",
        '{"verdicts": ["supported"]}',
        '{"verdicts": ["yes", "no"]}',
        '["supported", "supported"]',
        "{}",
    ],
)
def test_an_answer_out_of_shape_is_a_guard_that_could_not_judge(answer):
    check = ImageEvidence(ImageEvidenceConfig(), FakeChat(answer))
    with pytest.raises(GuardUnavailable):
        run(check.check(_request(RED), ["The apple is red.", "It is on a table."]))
    # nothing was cached from it
    chat = FakeChat(_verdicts("supported", "supported"))
    check.chat = chat
    assert run(check.check(_request(RED), ["The apple is red.", "It is on a table."])).asked == 2


def test_limits_on_images_and_claims_and_the_cache():
    chat = FakeChat(_verdicts("supported"), _verdicts("supported"), _verdicts("supported"))
    check = ImageEvidence(ImageEvidenceConfig(max_images=1, max_claims=1, cache_size=1, model="vl"), chat)
    seen = run(check.check(_request(RED, BLUE), ["A.", "B."]))
    assert (seen.images, seen.of_images, len(seen.labels)) == (1, 2, 1)
    assert chat.asked[0].model == "vl"
    run(check.check(_request(RED), ["C."]))  # pushes "A." out of a cache of one
    assert run(check.check(_request(RED), ["A."])).asked == 1
