"""Pieces of the chat-completions surface without a server: unknown fields found where the client put them,
engine refusals in the gateway's words, tool-call fragments reassembled, engines that cannot honour a field."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from core.digest import OutputDigest
from core.errors import EngineFailed, InvalidRequest
from core.events import Completion, Delta, merge_tool_calls
from core.schemas import ChatCompletionRequest
from engines.adapters.openai_compat import rejection
from engines.adapters.settings import EngineConfig
from engines.selection.pool import EnginePool, build_engine
from gateway.fields import UnknownField, parse_request
from gateway.pipeline import Pipeline
from observability.metrics import Metrics
from policies.registry import available_plugins, build_chain
from policies.settings import PolicyChainConfig

USER = [{"role": "user", "content": "hi"}]


def test_refuse_names_the_innermost_unknown_field():
    doc = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "fidelity": "max"}}
                ],
            }
        ],
    }
    with pytest.raises(UnknownField) as err:
        parse_request(doc, "refuse")
    assert err.value.param == "messages.0.content.0.image_url.fidelity" and err.value.status == 400


def test_drop_removes_every_unknown_field_and_keeps_the_rest():
    doc = {
        "model": "m",
        "top_k": 3,
        "x": 1,
        "stream_options": {"include_usage": True, "y": 2},
        "messages": [{"role": "user", "content": "hi", "z": 3}],
    }
    req, dropped = parse_request(doc, "drop")
    assert sorted(dropped) == ["messages.0.z", "stream_options.y", "x"]
    assert (
        req.top_k == 3 and req.include_usage and req.messages[0].wire() == {"role": "user", "content": "hi"}
    )


def test_drop_still_refuses_what_is_invalid():
    with pytest.raises(ValidationError):
        parse_request({"model": "m", "messages": USER, "temperature": 9, "x": 1}, "drop")


@pytest.mark.parametrize(
    "doc",
    [
        {
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        {"tool_choice": "required"},
        {"top_logprobs": 2},
        {"response_format": {"type": "json_schema"}},
        {"chat_template_kwargs": {"chat_template": True}},
        {"logit_bias": {"token": 1.0}},
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
    ],
)
def test_inconsistent_tool_and_format_fields_are_invalid(doc):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **doc})


@pytest.mark.parametrize(
    "said, code, param",
    [
        (
            (
                "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                "input tokens"
            ),
            "context_length_exceeded",
            "messages",
        ),
        (
            "max_tokens=9000 cannot be greater than max_model_len=2048.",
            "context_length_exceeded",
            "max_tokens",
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's maximum context length is 2048",
            "context_length_exceeded",
            "max_tokens",
        ),
        (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "engine_rejected_request",
            "tools",
        ),
        ("Invalid JSON schema in response_format", "engine_rejected_request", "response_format"),
        ("n must be 1 when using greedy sampling, got 2.", "engine_rejected_request", "n"),
        ("something else entirely at /srv/secret", "engine_rejected_request", None),
    ],
)
def test_engine_rejections_are_mapped_to_the_gateways_words(said, code, param):
    err = rejection(f"engine e answered 400: {said}", said, engine="e", upstream_status=400)
    assert (err.status, err.code, err.param) == (400, code, param)
    assert said not in err.message and "engine e" not in err.message
    assert said in err.detail  # for the log


def test_engine_error_messages_never_carry_the_detail():
    err = EngineFailed("engine gpu-7 answered 500: CUDA out of memory at /opt/x", engine="gpu-7")
    assert "gpu-7" not in err.to_dict()["error"]["message"] and "CUDA" not in str(err.to_dict())


def test_streamed_fragments_fold_into_whole_calls():
    calls: list[dict] = []
    merge_tool_calls(
        calls, [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]
    )
    merge_tool_calls(calls, [{"index": 0, "function": {"arguments": '{"x"'}}])
    merge_tool_calls(
        calls,
        [
            {"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}},
            {"index": 0, "function": {"arguments": ": 1}"}},
        ],
    )
    assert calls == [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


def test_tool_call_arguments_are_in_the_audit_digest_streamed_or_whole():
    streamed = OutputDigest()
    for frag in (
        [{"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"x": 1}'}}],
    ):
        streamed.add(Delta(tool_calls=frag))
    whole = Completion(
        tool_calls=[{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    )
    other = Completion(
        tool_calls=[{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]
    )
    assert streamed.to_json() == OutputDigest.of(whole).to_json()
    assert streamed.to_json()["tool_calls_sha256"] != OutputDigest.of(other).to_json()["tool_calls_sha256"]
    assert "tool_calls_sha256" not in OutputDigest.of(Completion(text="plain")).to_json()


def test_an_engine_that_cannot_honour_a_field_is_never_sent_it():
    metrics = Metrics(CollectorRegistry())
    local = build_engine(EngineConfig(name="cpu", kind="local", model="smollm2", serves=["m"]))
    vllm = build_engine(
        EngineConfig(name="gpu", kind="vllm", base_url="http://127.0.0.1:9/v1", model="x", serves=["both"])
    )
    also_local = build_engine(EngineConfig(name="cpu2", kind="local", model="smollm2", serves=["both"]))
    pipeline = Pipeline(
        EnginePool([local, vllm, also_local], metrics),
        build_chain(PolicyChainConfig(pre=[]), available_plugins()),
        metrics,
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": tools})
    with pytest.raises(InvalidRequest) as err:
        pipeline._engines_for(req)
    assert err.value.param == "tools" and err.value.status == 400
    both = ChatCompletionRequest.model_validate({"model": "both", "messages": USER, "logprobs": True})
    assert [e.name for e in pipeline._engines_for(both)] == ["gpu"]
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    assert [e.name for e in pipeline._engines_for(plain)] == ["cpu"]


def test_the_audit_record_digests_the_tool_calls_a_conversation_carries():
    import hashlib

    from core.context import RequestContext
    from observability.audit.record import RequestSnapshot, request_payload

    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "42"},
            ],
        }
    )
    payload = request_payload(RequestSnapshot(RequestContext.new("r"), req, None, None, 1.0))
    sha = hashlib.sha256(b'f{"a": 1}').hexdigest()
    assert {"role": "assistant", "type": "tool_call", "sha256": sha, "chars": 9} in payload["input"]
    assert [e["type"] for e in payload["input"]] == ["text", "tool_call", "text"]
