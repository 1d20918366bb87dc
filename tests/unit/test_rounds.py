"""The verdict loop's one decision (gateway/pipeline/verdicts.py ``Rounds.judge``), which the stream and the
whole answer both follow: serve, retry while the budget lasts and nothing went out, serve the best attempt
when it runs out, finish flagged once something went out, or refuse."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from core.context import RequestContext
from core.errors import AnswerWithheld, InvalidRequest
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from gateway.pipeline.verdicts import Rounds
from observability.metrics import Metrics
from policies.base import Accept, Reject, Retry


class _Accounting:
    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []

    def policy_ran(self, policy: Any, ctx: Any, kind: str, *_: Any) -> None:
        self.ran.append((policy.name, kind))


def _rounds(max_retries: int) -> tuple[Rounds, RequestContext, _Accounting]:
    ctx = RequestContext.new("req-1")
    chain = SimpleNamespace(max_retries=max_retries, post=[SimpleNamespace(name="grounding")])
    accounting = _Accounting()
    rounds = Rounds(chain, ctx, Metrics(CollectorRegistry()), accounting)  # type: ignore[arg-type]
    return rounds, ctx, accounting


def _request(text: str = "hi") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": text}]}
    )


def test_an_accepted_attempt_is_served_with_its_headers_while_nothing_went_out():
    rounds, ctx, _ = _rounds(2)
    completion = Completion()
    step = rounds.judge(Accept(headers={"x-a": "1"}), [Accept(headers={"x-a": "1"})], _request(), completion)
    assert step.again is None and step.completion is completion and not step.best
    assert ctx.outputs.response_headers == {"x-a": "1"}


def test_headers_of_a_verdict_after_the_first_byte_are_not_added():
    rounds, ctx, _ = _rounds(2)
    rounds.judge(
        Accept(headers={"x-a": "1"}), [Accept(headers={"x-a": "1"})], _request(), Completion(), released=True
    )
    assert ctx.outputs.response_headers == {}


def test_a_retry_spends_the_budget_with_the_adjusted_request_then_the_best_attempt_is_served():
    rounds, ctx, accounting = _rounds(1)
    first, second = Completion(), Completion()
    low = Retry("grounding", update={"temperature": 0.0}, score=0.3, exhausted=Accept(notes={"n": 1}))
    step = rounds.judge(low, [], _request(), first)
    assert step.again is not None and step.again.temperature == 0.0 and rounds.budget == 0
    assert ctx.record.retries == 1
    high = Retry("grounding", score=0.7, exhausted=Accept(notes={"n": 1}))
    step = rounds.judge(high, [], step.again, second, lambda: [Delta(text="kept")])
    assert step.best and step.completion is second and [d.text for d in step.release()] == ["kept"]
    assert ctx.outputs.degraded == ["retries-exhausted"] and ctx.outputs.notes == {"n": 1}
    assert accounting.ran == [("grounding", "exhausted_serve")]


def test_once_something_went_out_there_is_no_retry_the_answer_finishes_flagged():
    rounds, ctx, _ = _rounds(3)
    completion = Completion()
    step = rounds.judge(Retry("grounding", score=0.1), [], _request(), completion, released=True)
    assert step.again is None and step.completion is completion and not step.best and rounds.budget == 3
    assert ctx.outputs.degraded == ["retries-exhausted"]


def test_a_refusal_is_raised_whether_first_or_when_the_retries_run_out():
    rounds, _, _ = _rounds(0)
    with pytest.raises(InvalidRequest):
        rounds.judge(Reject(InvalidRequest("no")), [], _request(), Completion())
    with pytest.raises(InvalidRequest):
        rounds.judge(Retry("grounding", exhausted=Reject(InvalidRequest("no"))), [], _request(), Completion())
    with pytest.raises(InvalidRequest):
        rounds.judge(
            Retry("grounding", exhausted=Reject(InvalidRequest("no"))),
            [],
            _request(),
            Completion(),
            released=True,
        )


def test_a_halted_attempt_is_never_served_later_so_with_none_whole_the_answer_is_withheld():
    rounds, _, _ = _rounds(0)
    with pytest.raises(AnswerWithheld):
        rounds.judge(Retry("grounding", score=0.9), [], _request(), Completion(), whole=False)
