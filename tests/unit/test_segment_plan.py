"""Segmentation is a plan (data) the pipeline executes: the request for segment i is the request the
pre-policies returned with the plan's first part swapped for segment i's, the prompt kept."""

from __future__ import annotations

import dataclasses

import pytest

from core.context import SegmentPlan
from core.events import Completion, Usage
from core.schemas import ChatCompletionRequest
from gateway.pipeline.segments import join, segment_request, segmented


def _audio(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _request(data: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "x",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "transcribe"}, _audio(data)]},
            ],
        }
    )


def _plan(request: ChatCompletionRequest, n: int) -> SegmentPlan:
    parts = [_request(f"seg{i}").messages[0].content[1] for i in range(n)]  # type: ignore[index]
    first = request.messages[0].content[1]  # type: ignore[index]
    return SegmentPlan("messages.0.content.1", [(i * 10.0, i * 10.0 + 10.0) for i in range(n)], first, parts)


def test_the_request_for_a_segment_swaps_only_the_planned_part():
    request = _request("seg0")
    plan = _plan(request, 3)
    second = segment_request(request, plan, 2)
    assert second.messages[0].content[1].input_audio.data == "seg2"  # type: ignore[index,union-attr]
    assert second.messages[0].content[0] == request.messages[0].content[0]  # type: ignore[index]
    assert request.messages[0].content[1].input_audio.data == "seg0"  # type: ignore[index,union-attr]


def test_a_plan_is_frozen_data_and_one_segment_is_no_segmentation():
    request = _request("seg0")
    plan = _plan(request, 1)
    assert not segmented(plan) and not segmented(None) and segmented(_plan(request, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.separator = " "  # type: ignore[misc]


def test_the_segments_answers_join_into_one_with_usage_summed():
    parts = []
    for i, reason in enumerate(["length", "stop"]):
        c = Completion(finish_reason=reason)
        c.text, c.usage = f"part {i}", Usage(10, 5)
        parts.append(c)
    out = join(parts, "\n\n")
    assert out.text == "part 0\n\npart 1" and out.finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (20, 10)
