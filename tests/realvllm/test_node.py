"""The openai-node SDK through the gateway against the real vLLM, compared with the same SDK straight to vLLM."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.node import sdk
from tests.realvllm.conftest import MODEL

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(1800)]

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def both(real_gateway, vllm, mode: str, request: dict) -> tuple[dict, dict]:
    return (
        sdk.call(real_gateway.url + "/v1", mode, {**request, "model": MODEL}),
        sdk.call(vllm.base_url, mode, {**request, "model": "smollm2"}),
    )


def test_node_streaming_and_json_match_vllm(real_gateway, vllm):
    req = {"messages": PROMPT, "max_tokens": 16, "temperature": 0, "stream_options": {"include_usage": True}}
    got, want = both(real_gateway, vllm, "stream", req)
    g, w = sdk.stream_text(got["chunks"]), sdk.stream_text(want["chunks"])
    assert g[0] == w[0] and g[1] == w[1] == "length"
    assert g[2]["completion_tokens"] == w[2]["completion_tokens"] == 16
    req.pop("stream_options")
    got, want = both(real_gateway, vllm, "create", req)
    assert (
        got["completion"]["choices"][0]["message"]["content"]
        == want["completion"]["choices"][0]["message"]["content"]
    )
    assert got["completion"]["usage"]["prompt_tokens"] == want["completion"]["usage"]["prompt_tokens"]


def test_node_tool_calls_match_vllm(real_gateway, vllm):
    req = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
    }
    got, want = both(real_gateway, vllm, "helper", req)
    g, w = got["completion"]["choices"][0], want["completion"]["choices"][0]
    assert g["finish_reason"] == w["finish_reason"] == "tool_calls"
    assert [c["function"] for c in g["message"]["tool_calls"]] == [
        c["function"] for c in w["message"]["tool_calls"]
    ]


def test_node_response_format_is_valid_json(real_gateway, vllm):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    req = {
        "messages": PROMPT,
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    got, want = both(real_gateway, vllm, "create", req)
    text = got["completion"]["choices"][0]["message"]["content"]
    assert text == want["completion"]["choices"][0]["message"]["content"]
    assert got["completion"]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_node_sees_an_engine_400_as_the_gateways_400(real_gateway, vllm):
    req = {"messages": [{"role": "user", "content": "word " * 2500}], "max_tokens": 4}
    got, want = both(real_gateway, vllm, "stream", req)
    assert want["error"]["status"] == 400
    assert got["error"]["status"] == 400 and got["error"]["body"]["code"] == "context_length_exceeded"
