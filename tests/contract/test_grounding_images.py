"""Images are evidence: the example config's chain asks an engine about what the request's pictures show.

The gateway runs the policy chain of ops/config/omnigate.yaml as written in front of the scripted
vLLM-Omni engines. A question about a picture states nothing in its text, but the picture is evidence:
the answer's claims go, with the picture, to the engine in one verification call (a JSON verdict per
claim), through the gateway's own routing. An answer the picture supports is served unflagged; one it
contradicts (a green apple in a picture of a red one) is retried, streamed and not; an engine that
cannot say is a guard that could not judge (fail closed: 503 ``guard_unavailable``). The receipt names
the pictures it looked at and the model that looked.
"""

from __future__ import annotations

import itertools

import openai
import orjson
import pytest

from policies.grounding.image_evidence import INSTRUCTION
from tests.conftest import OMNI_MODEL
from tests.contract.conftest import EXAMPLE_ADMIN_KEY
from tests.contract.test_grounding_evidence import _ask
from tests.harness import audit_payload
from tests.media import data_uri, plain_image, png
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)

QUESTION = "What fruit is in the picture, and what colour is it?"
RIGHT = "The picture shows a red apple on a wooden table."
WRONG = "The picture shows a green apple on a wooden table."
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


_sizes = itertools.count(64)


def _picture() -> list[dict]:
    """A picture no earlier test showed: the guard's verdicts are cached per picture and claim."""
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(next(_sizes))))}}
    return [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}]


def _verdicts(*labels: str) -> Script:
    return Script(flavour="omni", text=orjson.dumps({"verdicts": list(labels)}).decode())


def _answer(text: str) -> Script:
    return Script(flavour="omni", text=text, chunk_words=2)


@STREAMS
def test_an_answer_the_picture_supports_is_served_unflagged(example_chain_gateway, upstreams, stream):
    server, client = example_chain_gateway()
    upstreams.omni_a.enqueue(_answer(RIGHT))
    upstreams.omni_a.enqueue(_verdicts("supported"))
    raw, text, notes = _ask(client, _picture(), stream)
    assert text == RIGHT
    assert "x-omnigate-grounding" not in raw.headers and "x-omnigate-degraded" not in raw.headers
    assert notes is not None and notes["grounding"]["verdict"] == "pass"
    assert notes["grounding"]["supported"] == 1
    # the answer, then one verification call: the picture and the claim, a JSON verdict asked for
    assert upstreams.omni_a.request_count == 2
    check = upstreams.omni_a.requests[1]
    assert check["messages"][0] == {"role": "system", "content": INSTRUCTION}
    parts = check["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/")
    assert "1. The picture shows a red apple on a wooden table." in parts[1]["text"]
    assert check["response_format"]["type"] == "json_schema" and check["temperature"] == 0
    assert not check.get("stream")
    payload = audit_payload(server.url, EXAMPLE_ADMIN_KEY, raw.headers["x-request-id"])
    (receipt,) = [p for p in payload["policies"] if p["name"] == "grounding"]
    images = next(p for p in receipt["saw"]["parts"] if p["part"] == "images")
    assert (images["images"], images["of"], images["claims_checked"], images["asked_engine"]) == (1, 1, 1, 1)
    assert images["model"] == OMNI_MODEL
    assert receipt["complete"] is True


@STREAMS
def test_an_answer_that_misstates_the_picture_is_retried(example_chain_gateway, upstreams, stream):
    server, client = example_chain_gateway()
    for script in (_answer(WRONG), _verdicts("contradicted"), _answer(RIGHT), _verdicts("supported")):
        upstreams.omni_a.enqueue(script)
    raw, text, notes = _ask(client, _picture(), stream)
    assert text == RIGHT  # the green apple never reached the client
    assert upstreams.omni_a.request_count == 4
    assert (
        notes is not None and notes["grounding"]["verdict"] == "pass" and notes["grounding"]["attempt"] == 2
    )
    assert "x-omnigate-grounding" not in raw.headers
    assert audit_payload(server.url, EXAMPLE_ADMIN_KEY, raw.headers["x-request-id"])["retries"] == 1


def test_the_same_claim_about_the_same_picture_is_asked_once(example_chain_gateway, upstreams):
    _server, client = example_chain_gateway()
    for script in (_answer(RIGHT), _verdicts("supported"), _answer(RIGHT)):
        upstreams.omni_a.enqueue(script)
    picture = _picture()
    for _ in range(2):
        _raw, text, notes = _ask(client, picture, False)
        assert text == RIGHT and notes["grounding"]["verdict"] == "pass"
    assert upstreams.omni_a.request_count == 3  # the second answer's claim came from the cache


@pytest.mark.parametrize("reply", ["I think it is fine.", '{"verdicts": []}'])
def test_an_engine_that_cannot_say_fails_closed(example_chain_gateway, upstreams, reply):
    _server, client = example_chain_gateway()
    upstreams.omni_a.enqueue(_answer(WRONG))
    # an engine without structured output, whose answer is not the verdicts asked for
    upstreams.omni_a.enqueue(Script(flavour="omni", text=reply, ignore_response_format=True))
    with pytest.raises(openai.InternalServerError) as err:
        _ask(client, _picture(), False)
    assert err.value.status_code == 503 and err.value.body["code"] == "guard_unavailable"
    assert "127.0.0.1" not in err.value.body["message"]
