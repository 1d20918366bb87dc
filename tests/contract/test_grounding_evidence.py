"""Grounding judges what the request's own evidence bears on: the example config's chain, the openai SDK.

The gateway runs the policy chain of ops/config/omnigate.yaml as written (its grounding guard in
``window`` mode, the fallback scorer, two retries) in front of the scripted vLLM-Omni engines. An
open-domain question has no evidence: one engine call, no retry, no flag, and the header, the notes and
the audit record say "no evidence". A document in the system or user message is evidence: a consistent
answer passes, an answer that contradicts it (another weekday, another revenue) is retried and then
flagged (or refused, with ``on_exhausted: refuse``), streamed and not, in English and in Chinese.
"""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest

from policies.grounding.policy import DEFAULT_INSTRUCTION
from tests.conftest import OMNI_MODEL
from tests.contract.conftest import EXAMPLE_ADMIN_KEY
from tests.harness import audit_payload
from tests.media import speech
from tests.upstream import Script

pytestmark = pytest.mark.timeout(180)


OPEN_QUESTION = "What is the capital of France?"
OPEN_ANSWER = "Paris is the capital of France."
DOC = (
    "Minutes of the planning call. The board meeting is on Tuesday at 3 pm in Room 4. "
    "Revenue in 2025 was 12 million euros."
)
QUESTION = "When is the board meeting, and what was the revenue in 2025?"
CONSISTENT = "The board meeting is on Tuesday at 3 pm. Revenue in 2025 was 12 million euros."
WRONG_DAY = "The board meeting is on Friday at 3 pm. Revenue in 2025 was 12 million euros."
# The contradiction first: in window mode a sentence that passed is released, and what follows it can
# then only end the stream (test_window_mode_ends_the_stream_at_a_contradiction_after_a_release).
WRONG_REVENUE = "Revenue in 2025 was 15 million euros. The board meeting is on Tuesday at 3 pm."
DOC_ZH = "董事会会议定于星期二下午三点在北京举行。公司2024年营收为1200万元。"
QUESTION_ZH = "会议在哪天举行？"
CONSISTENT_ZH = "会议在星期二下午三点举行。"
WRONG_ZH = "会议在星期五下午三点举行。"
OPEN_QUESTION_ZH = "法国的首都是哪里？"
OPEN_ANSWER_ZH = "巴黎是法国的首都。"


def _ask(client: openai.OpenAI, messages: list[dict], stream: bool) -> tuple[Any, str, dict | None]:
    """The raw response, the answer's text and the ``omnigate`` notes, streamed or not."""
    raw = client.chat.completions.with_raw_response.create(model=OMNI_MODEL, messages=messages, stream=stream)
    parsed = raw.parse()
    if not stream:
        return raw, parsed.choices[0].message.content or "", (parsed.model_extra or {}).get("omnigate")
    text, notes = "", None
    for chunk in parsed:
        notes = (chunk.model_extra or {}).get("omnigate") or notes
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return raw, text, notes


def _with_doc(doc: str, question: str, where: str) -> list[dict]:
    if where == "system":
        return [{"role": "system", "content": doc}, {"role": "user", "content": question}]
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


@STREAMS
@pytest.mark.parametrize(
    ("question", "answer"),
    [(OPEN_QUESTION, OPEN_ANSWER), (OPEN_QUESTION_ZH, OPEN_ANSWER_ZH)],
    ids=["en", "zh"],
)
def test_an_open_domain_question_is_served_once_unflagged_and_recorded_as_no_evidence(
    example_chain_gateway, upstreams, stream, question, answer
):
    server, client = example_chain_gateway()
    upstreams.omni_a.default = Script(flavour="omni", text=answer, chunk_words=2)
    raw, text, notes = _ask(client, [{"role": "user", "content": question}], stream)
    assert text == answer
    assert upstreams.omni_a.request_count == 1  # no retry
    assert raw.headers["x-omnigate-grounding"] == "no-evidence"  # not "low", and not silently passed
    assert "x-omnigate-degraded" not in raw.headers
    assert notes is not None and notes["grounding"]["verdict"] == "skipped"
    assert notes["grounding"]["reason"] == "no_evidence"
    payload = audit_payload(server.url, EXAMPLE_ADMIN_KEY, raw.headers["x-request-id"])
    assert payload["notes"]["grounding"]["reason"] == "no_evidence"
    (receipt,) = [p for p in payload["policies"] if p["name"] == "grounding"]
    # Not judged, and its receipt says so: the answer was not looked at for want of evidence.
    assert receipt["complete"] is False
    assert {"part": "answer", "why": "no_evidence"} in receipt["saw"]["missed"], receipt


@STREAMS
@pytest.mark.parametrize("where", ["system", "user"])
def test_a_consistent_answer_to_a_document_passes(example_chain_gateway, upstreams, stream, where):
    server, client = example_chain_gateway()
    upstreams.omni_a.default = Script(flavour="omni", text=CONSISTENT, chunk_words=2)
    raw, text, notes = _ask(client, _with_doc(DOC, QUESTION, where), stream)
    assert text == CONSISTENT
    assert upstreams.omni_a.request_count == 1
    assert "x-omnigate-grounding" not in raw.headers
    assert notes is not None and notes["grounding"]["verdict"] == "pass"
    assert notes["grounding"]["supported"] == 2 and notes["grounding"]["contradicted"] == 0
    payload = audit_payload(server.url, EXAMPLE_ADMIN_KEY, raw.headers["x-request-id"])
    (receipt,) = [p for p in payload["policies"] if p["name"] == "grounding"]
    (part,) = receipt["saw"]["parts"]
    assert (part["supported"], part["contradicted"], part["unverifiable"]) == (2, 0, 0)
    assert receipt["complete"] is True


@STREAMS
@pytest.mark.parametrize("wrong", [WRONG_DAY, WRONG_REVENUE], ids=["weekday", "revenue"])
def test_a_contradiction_of_the_document_is_retried_then_flagged(
    example_chain_gateway, upstreams, stream, wrong
):
    server, client = example_chain_gateway()
    upstreams.omni_a.enqueue(Script(flavour="omni", text=wrong, chunk_words=2))
    upstreams.omni_a.default = Script(flavour="omni", text=CONSISTENT, chunk_words=2)
    raw, text, notes = _ask(client, _with_doc(DOC, QUESTION, "system"), stream)
    # Caught before anything was sent; the retry is told to keep to the document, and it does.
    assert text == CONSISTENT
    assert upstreams.omni_a.request_count == 2
    assert upstreams.omni_a.requests[1]["messages"][0] == {"role": "system", "content": DEFAULT_INSTRUCTION}
    assert "x-omnigate-grounding" not in raw.headers
    assert (
        notes is not None and notes["grounding"]["verdict"] == "pass" and notes["grounding"]["attempt"] == 2
    )
    payload = audit_payload(server.url, EXAMPLE_ADMIN_KEY, raw.headers["x-request-id"])
    assert payload["retries"] == 1

    # Contradicted every time: the example config flags the last attempt after its two retries.
    upstreams.reset()
    upstreams.omni_a.default = Script(flavour="omni", text=wrong, chunk_words=2)
    raw, text, notes = _ask(client, _with_doc(DOC, QUESTION, "user"), stream)
    assert text == wrong
    assert upstreams.omni_a.request_count == 3
    assert raw.headers["x-omnigate-grounding"] == "low"
    assert "retries-exhausted" in raw.headers["x-omnigate-degraded"]
    assert notes is not None and notes["grounding"]["verdict"] == "low"
    assert notes["grounding"]["contradicted"] == 1
    assert "the evidence says" in notes["grounding"]["weakest"]


@STREAMS
def test_a_contradiction_is_refused_when_the_config_says_refuse(example_chain_gateway, upstreams, stream):
    _server, client = example_chain_gateway("refuse")
    upstreams.omni_a.default = Script(flavour="omni", text=WRONG_DAY, chunk_words=2)
    with pytest.raises(openai.UnprocessableEntityError) as err:
        _ask(client, _with_doc(DOC, QUESTION, "system"), stream)
    assert err.value.body["code"] == "grounding_failed"
    assert "Friday" in err.value.body["message"] or "friday" in err.value.body["message"]
    assert "Tuesday" in err.value.body["message"]
    assert upstreams.omni_a.request_count == 3


@STREAMS
def test_a_chinese_document_is_evidence_in_chinese(example_chain_gateway, upstreams, stream):
    _server, client = example_chain_gateway()
    upstreams.omni_a.default = Script(flavour="omni", text=CONSISTENT_ZH, chunk_words=1)
    raw, text, notes = _ask(client, _with_doc(DOC_ZH, QUESTION_ZH, "system"), stream)
    assert text == CONSISTENT_ZH and upstreams.omni_a.request_count == 1
    assert notes is not None and notes["grounding"]["verdict"] == "pass"

    upstreams.reset()
    upstreams.omni_a.enqueue(Script(flavour="omni", text=WRONG_ZH, chunk_words=1))
    upstreams.omni_a.default = Script(flavour="omni", text=CONSISTENT_ZH, chunk_words=1)
    raw, text, notes = _ask(client, _with_doc(DOC_ZH, QUESTION_ZH, "user"), stream)
    assert text == CONSISTENT_ZH
    assert upstreams.omni_a.request_count == 2  # the contradiction was caught and retried
    assert "x-omnigate-grounding" not in raw.headers

    upstreams.reset()
    upstreams.omni_a.default = Script(flavour="omni", text=WRONG_ZH, chunk_words=1)
    raw, text, notes = _ask(client, _with_doc(DOC_ZH, QUESTION_ZH, "system"), stream)
    assert raw.headers["x-omnigate-grounding"] == "low"
    assert notes is not None and notes["grounding"]["contradicted"] == 1


@STREAMS
def test_a_claim_the_document_does_not_bear_on_is_unverifiable_not_failed(
    example_chain_gateway, upstreams, stream
):
    _server, client = example_chain_gateway()
    answer = "The board meeting is on Tuesday at 3 pm. Paris is the capital of France."
    upstreams.omni_a.default = Script(flavour="omni", text=answer, chunk_words=2)
    raw, text, notes = _ask(client, _with_doc(DOC, QUESTION, "system"), stream)
    assert text == answer and upstreams.omni_a.request_count == 1
    assert "x-omnigate-grounding" not in raw.headers
    assert notes is not None
    assert (notes["grounding"]["supported"], notes["grounding"]["unverifiable"]) == (1, 1)


def test_window_mode_ends_the_stream_at_a_contradiction_after_a_release(example_chain_gateway, upstreams):
    _server, client = example_chain_gateway()
    late = "The board meeting is on Tuesday at 3 pm. Revenue in 2025 was 15 million euros."
    upstreams.omni_a.default = Script(flavour="omni", text=late, chunk_words=2)
    text = ""
    with pytest.raises(openai.APIError) as err:
        stream = client.chat.completions.create(
            model=OMNI_MODEL, messages=_with_doc(DOC, QUESTION, "system"), stream=True
        )
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
    # The first sentence passed and went out; the contradiction never did.
    assert text == "The board meeting is on Tuesday at 3 pm. "
    assert "15" not in text
    assert "contradicts the evidence" in str(err.value)
    assert upstreams.omni_a.request_count == 1


@STREAMS
def test_a_spoken_question_is_served_once_unflagged(example_chain_gateway, upstreams, stream):
    """A question asked aloud carries no text that states anything (the example chain transcribes no
    speech): served once, unflagged, recorded as no evidence; neither retried nor cut."""
    _server, client = example_chain_gateway()
    upstreams.omni_a.default = Script(flavour="omni", text=OPEN_ANSWER, chunk_words=2)
    spoken = base64.b64encode(speech("what is the capital of france")).decode()
    part = {"type": "input_audio", "input_audio": {"data": spoken, "format": "wav"}}
    raw, text, notes = _ask(client, [{"role": "user", "content": [part]}], stream)
    assert text == OPEN_ANSWER
    assert upstreams.omni_a.request_count == 1
    assert raw.headers["x-omnigate-grounding"] == "no-evidence"
    assert "x-omnigate-degraded" not in raw.headers
    assert notes is not None and notes["grounding"]["reason"] == "no_evidence"
