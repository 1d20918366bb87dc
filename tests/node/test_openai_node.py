"""The contract suite with the official openai-node SDK: a real uvicorn gateway, the scripted vLLM over real
sockets, node scripts driven from here (tests/node/sdk.py). tests/realvllm/test_node.py runs it against a real
vLLM."""

from __future__ import annotations

import pytest

from tests.conftest import TEXT_MODEL
from tests.node import sdk
from tests.upstream import Script

pytestmark = pytest.mark.timeout(600)  # node and npm come from scripts/test-env.sh

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def url(gateway) -> str:
    return gateway.url + "/v1"


def test_streaming_with_usage(url, ups):
    ups.vllm.default = Script(text="One two three four.")
    got = sdk.call(
        url, "stream", {"model": TEXT_MODEL, "messages": USER, "stream_options": {"include_usage": True}}
    )
    text, finish, usage = sdk.stream_text(got["chunks"])
    assert text == "One two three four." and finish == "stop"
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4


def test_non_streaming(url, ups):
    ups.vllm.default = Script(text="Plain answer.")
    got = sdk.call(url, "create", {"model": TEXT_MODEL, "messages": USER, "max_tokens": 1})
    choice = got["completion"]["choices"][0]
    assert choice["message"]["content"] == "Plain " and choice["finish_reason"] == "length"


def test_streamed_tool_calls_reassembled_by_the_node_sdk(url, ups):
    args = '{"city": "Paris"}'
    ups.vllm.default = Script(
        text="", tool_calls=[{"name": "get_weather", "arguments": args}], tool_chunk_chars=3
    )
    got = sdk.call(url, "helper", {"model": TEXT_MODEL, "messages": USER, "tools": [WEATHER]})
    choice = got["completion"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": args}
    assert ups.vllm.requests[-1]["tools"] == [WEATHER]


def test_non_streamed_tool_calls_and_a_tool_result_turn(url, ups):
    ups.vllm.default = Script(text="", tool_calls=[{"name": "get_weather", "arguments": "{}"}])
    got = sdk.call(
        url, "create", {"model": TEXT_MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    )
    call = got["completion"]["choices"][0]["message"]["tool_calls"][0]
    ups.vllm.default = Script(text="It is 18 degrees.")
    follow = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18"},
    ]
    got = sdk.call(url, "create", {"model": TEXT_MODEL, "messages": follow, "tools": [WEATHER]})
    assert got["completion"]["choices"][0]["message"]["content"] == "It is 18 degrees."
    assert ups.vllm.requests[-1]["messages"][2] == {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": "18",
    }


def test_response_format(url, ups):
    ups.vllm.default = Script(text='{"city": "Paris"}')
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": {"type": "object"}}}
    got = sdk.call(url, "create", {"model": TEXT_MODEL, "messages": USER, "response_format": fmt})
    assert got["completion"]["choices"][0]["message"]["content"] == '{"city": "Paris"}'
    assert ups.vllm.requests[-1]["response_format"] == fmt


def test_errors_reach_the_node_sdk_in_openai_shape(url, ups):
    got = sdk.call(url, "create", {"model": TEXT_MODEL, "messages": USER, "functions": [{"name": "f"}]})
    assert got["error"]["status"] == 400
    # A field OpenAI has and the gateway cannot honour says so (an unknown one is unknown_field).
    assert (
        got["error"]["body"]["param"] == "functions" and got["error"]["body"]["code"] == "unsupported_field"
    )
    ups.vllm.default = Script(fault="400_before_headers")
    got = sdk.call(url, "stream", {"model": TEXT_MODEL, "messages": USER})
    assert got["error"]["status"] == 400 and got["error"]["body"]["code"] == "context_length_exceeded"
    got = sdk.call(url, "create", {"model": "no-such-model", "messages": USER})
    assert got["error"]["status"] == 404


def test_a_large_media_part_from_the_node_sdk_reaches_the_engine_as_sent(url, ups):
    """A 1.3 MB audio part (spooled by the gateway as the body arrives, re-encoded into the engine's body)
    sent with openai-node: the engine gets the client's base64, the SDK a normal answer."""
    import base64

    from tests.conftest import OMNI_MODEL
    from tests.media import tone, wav

    b64 = base64.b64encode(wav(tone(40.0), 16000)).decode()
    part = {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    request = {"model": OMNI_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [part]}]}
    got = sdk.call(url, "create", request)
    assert got["completion"]["choices"][0]["message"]["content"]
    assert ups.omni_a.requests[-1]["messages"][0]["content"][0]["input_audio"]["data"] == b64


def test_a_spoken_conversation_appending_each_answer_as_the_sdk_returns_it(url, ups):
    from tests.conftest import OMNI_MODEL

    ups.omni_a.default = Script(flavour="omni", text="Paris it is.", audio_chunks=2)
    request = {
        "model": OMNI_MODEL,
        "messages": [{"role": "system", "content": "You are a voice assistant."}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "Ethan", "format": "wav"},
    }
    got = sdk.call(url, "converse", request, turns=["Capital of France?", "Say it again.", "Thanks."])
    assert "error" not in got, got
    completions = got["completions"]
    assert len(completions) == 3
    ids = [c["choices"][0]["message"]["audio"]["id"] for c in completions]
    assert len(set(ids)) == 3
    # The last request carried both earlier answers (their audio objects, as the SDK returned them); the
    # engine received each as the words it said, never the audio.
    sent = ups.omni_a.requests[-1]["messages"]
    assert [m for m in sent if m["role"] == "assistant"] == [
        {"role": "assistant", "content": "Paris it is."}
    ] * 2
    assert [m["content"] for m in sent if m["role"] == "user"] == [
        "Capital of France?",
        "Say it again.",
        "Thanks.",
    ]
