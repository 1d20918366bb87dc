"""The whole chat-completions surface through the gateway: the official openai SDK, a real uvicorn server and
the scripted vLLM over real sockets. Tools, structured output, logprobs, reasoning and the sampling fields reach
the engine as the client sent them, and what the engine answers comes back in OpenAI's (and vLLM's) shape;
a field the gateway does not forward is refused by name or, when so configured, dropped and announced."""

from __future__ import annotations

import json
import secrets

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gateway.fields import DROPPED_HEADER
from gateway.tenants import mint_key
from policies.settings import PolicyChainConfig, PolicySpec
from tests.conftest import TEXT_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.upstream import Script

pytestmark = pytest.mark.timeout(120)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}


def _user(text: str = "What is the weather in Paris?") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- tools -----------------------------------------------------------------------------------------------
def test_streamed_tool_calls_are_relayed_and_reassembled_by_the_sdk(client, ups):
    ups.vllm.default = Script(text="", tool_calls=[CALL], tool_chunk_chars=5)
    with client.chat.completions.stream(
        model=TEXT_MODEL,
        messages=_user(),
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        parallel_tool_calls=False,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == CALL["arguments"]
    assert call.id.startswith("chatcmpl-tool-")
    sent = ups.vllm.requests[-1]
    assert sent["tools"] == [WEATHER_TOOL]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False


def test_streamed_tool_call_fragments_keep_their_openai_shape(gateway, ups):
    ups.vllm.default = Script(text="", tool_calls=[CALL], tool_chunk_chars=8)
    body = {"model": TEXT_MODEL, "messages": _user(), "tools": [WEATHER_TOOL], "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    fragments = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in chunks
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert fragments[0] == [
        {
            "index": 0,
            "id": fragments[0][0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    assert "".join(f[0]["function"]["arguments"] for f in fragments[1:]) == CALL["arguments"]
    assert all(set(f[0]) == {"index", "function"} for f in fragments[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_non_streamed_tool_calls(client, ups):
    ups.vllm.default = Script(
        text="", tool_calls=[CALL, {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    )
    resp = client.chat.completions.create(
        model=TEXT_MODEL,
        messages=_user(),
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [c.function.arguments for c in choice.message.tool_calls] == [
        CALL["arguments"],
        '{"city": "Oslo"}',
    ]
    assert ups.vllm.requests[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_a_conversation_with_tool_results_reaches_the_engine_intact(client, ups):
    ups.vllm.default = Script(text="It is 18 degrees in Paris.")
    messages = [
        *_user(),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 18}'},
    ]
    resp = client.chat.completions.create(model=TEXT_MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert resp.choices[0].message.content == "It is 18 degrees in Paris."
    sent = ups.vllm.requests[-1]["messages"]
    assert sent[1] == {"role": "assistant", "tool_calls": messages[1]["tool_calls"]}
    assert sent[2] == messages[2]


def test_tool_messages_without_the_call_they_answer_are_refused(client, ups):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=TEXT_MODEL, messages=[*_user(), {"role": "tool", "content": "18"}]
        )
    assert "tool_call_id" in err.value.body["message"]
    assert ups.vllm.request_count == 0


# -- structured output, logprobs, reasoning, sampling -------------------------------------------------------
def test_response_format_json_schema_is_forwarded_under_its_wire_names(client, ups):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ups.vllm.default = Script(text='{"city": "Paris"}')
    resp = client.chat.completions.create(
        model=TEXT_MODEL,
        messages=_user(),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema, "strict": True},
        },
    )
    assert json.loads(resp.choices[0].message.content) == {"city": "Paris"}
    assert ups.vllm.requests[-1]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": True},
    }
    client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), response_format={"type": "json_object"}
    )
    assert ups.vllm.requests[-1]["response_format"] == {"type": "json_object"}


def test_sampling_fields_are_forwarded(client, ups):
    client.chat.completions.create(
        model=TEXT_MODEL,
        messages=_user(),
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"50256": -100},
        reasoning_effort="low",
        seed=7,
        stop=["\n\n"],
    )
    sent = ups.vllm.requests[-1]
    assert sent["presence_penalty"] == 0.5 and sent["frequency_penalty"] == -0.25
    assert sent["logit_bias"] == {"50256": -100} and sent["reasoning_effort"] == "low"
    assert sent["seed"] == 7 and sent["stop"] == ["\n\n"]


def test_streamed_logprobs_are_relayed(client, ups):
    ups.vllm.default = Script(text="One two three.")
    stream = client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), stream=True, logprobs=True, top_logprobs=2
    )
    entries = [
        e
        for chunk in stream
        for c in chunk.choices
        if c.logprobs and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert [e.token for e in entries] == ["One ", "two ", "three."]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    sent = ups.vllm.requests[-1]
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2


def test_non_streamed_logprobs_are_relayed(client, ups):
    ups.vllm.default = Script(text="One two.")
    resp = client.chat.completions.create(model=TEXT_MODEL, messages=_user(), logprobs=True, top_logprobs=1)
    assert [e.token for e in resp.choices[0].logprobs.content] == ["One ", "two."]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_is_relayed_under_the_engines_key(gateway, ups, key):
    ups.vllm.default = Script(text="Paris.", reasoning="The user asks about France.", reasoning_key=key)
    body = {"model": TEXT_MODEL, "messages": _user(), "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=20) as resp:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in resp.iter_lines()
            if line.startswith("data: {") and '"choices":[{' in line
        ]
    assert "".join(d.get(key, "") for d in deltas) == "The user asks about France."
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    whole = httpx.post(
        gateway.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=20
    ).json()
    assert whole["choices"][0]["message"][key] == "The user asks about France."


# -- unknown fields ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"verbosity_level": "high"}, "verbosity_level"),
        (
            {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]},
            "messages.0.cache_control",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "flavour": "x"}]}]},
            "messages.0.content.0.flavour",
        ),
        ({"response_format": {"type": "json_object", "indent": 2}}, "response_format.indent"),
        ({"tools": [{**WEATHER_TOOL, "cache": True}]}, "tools.0.cache"),
    ],
)
def test_an_unknown_field_is_refused_by_name(gateway, ups, extra, param):
    body = {"model": TEXT_MODEL, "messages": _user(), **extra}
    resp = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == "unknown_field" and param in err["message"]
    assert ups.vllm.request_count == 0


def test_chat_template_kwargs_take_only_allow_listed_keys(client, ups):
    for key in ("chat_template", "add_generation_prompt", "documents"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=TEXT_MODEL, messages=_user(), extra_body={"chat_template_kwargs": {key: True}}
            )
        assert key in err.value.body["message"] and err.value.body["param"] == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError):  # a template smuggled as a value of an allowed key
        client.chat.completions.create(
            model=TEXT_MODEL,
            messages=_user(),
            extra_body={"chat_template_kwargs": {"enable_thinking": "{{x}}"}},
        )
    assert ups.vllm.request_count == 0
    client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert ups.vllm.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.fixture(scope="module")
def dropping(bg, upstreams, tmp_path_factory):
    """A gateway that drops unknown fields globally, with one tenant that refuses them and one that drops."""
    keys = {"strict": mint_key(), "lenient": mint_key()}
    settings = gateway_settings(
        upstreams,
        requests={"unknown_fields": "drop"},
        tenants=[{"name": "strict", "unknown_fields": "refuse"}, {"name": "lenient"}],
        api_keys=[{"id": k.id, "tenant": n, "sha256": k.sha256} for n, k in keys.items()],
        audit={"sqlite_path": str(tmp_path_factory.mktemp("audit") / "audit.db")},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    server.keys = keys
    yield server
    server.stop()


def test_drop_mode_drops_and_says_so(dropping, ups):
    body = {
        "model": TEXT_MODEL,
        "stream": True,
        "api_base": "http://169.254.169.254",
        "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
    }
    headers = {"Authorization": f"Bearer {dropping.keys['lenient'].key}"}
    with httpx.stream(
        "POST", dropping.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
    ) as resp:
        assert resp.status_code == 200
        assert sorted(resp.headers[DROPPED_HEADER].split(",")) == ["api_base", "messages.0.cache_control"]
        resp.read()
    sent = ups.vllm.requests[-1]
    assert "api_base" not in sent and sent["messages"] == [{"role": "user", "content": "hi"}]
    strict = {"Authorization": f"Bearer {dropping.keys['strict'].key}"}
    refused = httpx.post(dropping.url + "/v1/chat/completions", json=body, headers=strict, timeout=10)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] in {"api_base", "messages.0.cache_control"}
    plain = httpx.post(
        dropping.url + "/v1/chat/completions",
        headers=headers,
        timeout=10,
        json={"model": TEXT_MODEL, "messages": _user()},
    )
    assert plain.status_code == 200 and DROPPED_HEADER not in plain.headers


# -- engine errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_400_for_a_long_prompt_is_the_gateways_own_400(client, ups, stream):
    ups.vllm.default = Script(fault="400_before_headers")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=TEXT_MODEL, messages=_user(), stream=stream)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert "2048" not in body["message"] and "text-vllm" not in body["message"]
    assert "context window" in body["message"]


def test_engine_failures_never_show_upstream_text_or_engine_names(gateway, ups):
    secret = "internal stack trace at /srv/models/llama-70b: CUDA OOM"
    ups.vllm.default = Script(
        fault="500_before_headers", status_body={"error": {"message": secret, "type": "InternalServerError"}}
    )
    resp = httpx.post(
        gateway.url + "/v1/chat/completions", timeout=10, json={"model": TEXT_MODEL, "messages": _user()}
    )
    assert resp.status_code == 502
    text = resp.text
    assert "CUDA" not in text and "text-vllm" not in text and "/srv" not in text
    assert resp.json()["error"]["message"] == "the model failed to answer; retry the request"
    ups.vllm.default = Script(fault="error_mid_stream", fault_after_chunks=2)
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        timeout=10,
        json={"model": TEXT_MODEL, "messages": _user(), "stream": True},
    ) as resp:
        frames = resp.read().decode()
    assert "engine failure mid-stream" not in frames and "text-vllm" not in frames
    assert '"code":"engine_error"' in frames


# -- policies see tool calls -------------------------------------------------------------------------------
def test_the_output_cap_counts_tool_call_arguments(client, ups):
    ups.vllm.default = Script(
        text="",
        tool_calls=[{"name": "get_weather", "arguments": "x" * 80}],
        tool_chunk_chars=4,
        ignore_max_tokens=True,
    )
    stream = client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), tools=[WEATHER_TOOL], max_tokens=5, stream=True
    )
    args, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or ():
                args += call.function.arguments or ""
    assert finish == "length"
    assert len(args) <= 5 * 4  # cut at the cap (5 pieces of 4 characters), not the engine's 80


@pytest.fixture(scope="module")
def grounded(bg, upstreams):
    made = {}

    def get(mode: str) -> GatewayServer:
        if mode not in made:
            chain = PolicyChainConfig(
                pre=[PolicySpec(name="request-limits")],
                post=[PolicySpec(name="grounding", config={"mode": mode, "on_exhausted": "refuse"})],
            )
            made[mode] = GatewayServer(bg, gateway_settings(upstreams, chain), CollectorRegistry()).start()
        return made[mode]

    yield get
    for s in made.values():
        s.stop()


@pytest.mark.parametrize(
    "mode, stream", [("hold", True), ("window", True), ("passthrough", True), ("hold", False)]
)
def test_grounding_does_not_score_a_tool_call_turn(grounded, ups, mode, stream):
    server = grounded(mode)
    # Arguments full of names and numbers the premise never states: claims, were they text.
    args = '{"city": "Ulaanbaatar", "date": "1987-03-14", "population": 1645000}'
    ups.vllm.default = Script(text="", tool_calls=[{"name": "get_weather", "arguments": args}])
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        if stream:
            with client.chat.completions.stream(
                model=TEXT_MODEL, messages=_user(), tools=[WEATHER_TOOL]
            ) as s:
                final = s.get_final_completion()
        else:
            final = client.chat.completions.create(model=TEXT_MODEL, messages=_user(), tools=[WEATHER_TOOL])
    assert final.choices[0].message.tool_calls[0].function.arguments == args
    assert final.choices[0].finish_reason == "tool_calls"
    assert ups.vllm.request_count == 1  # served at once, not retried as unsupported


def test_grounding_still_judges_the_answer_after_tool_results(grounded, ups):
    server = grounded("hold")
    ups.vllm.default = Script(text="It is 31 degrees in Paris and Gustave Eiffel built the Louvre in 1925.")
    messages = [
        *_user(),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Paris: 18 degrees, light rain."},
    ]
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": TEXT_MODEL, "messages": messages, "tools": [WEATHER_TOOL]},
    )
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "grounding_failed"


# -- n ---------------------------------------------------------------------------------------------------
def test_n_answers_come_back_as_n_choices_in_index_order(client, ups):
    ups.vllm.default = Script(text="Paris.")
    resp = client.chat.completions.create(model=TEXT_MODEL, messages=_user(), n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == ["Paris.", "Paris. [1]", "Paris. [2]"]
    assert ups.vllm.requests[-1]["n"] == 3


def test_streamed_n_answers_keep_their_indices(client, ups):
    ups.vllm.default = Script(text="Paris is big.")
    stream = client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), n=3, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: "Paris is big.", 1: "Paris is big. [1]", 2: "Paris is big. [2]"}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert usage.completion_tokens == 3 * 3 + 2
    assert ups.vllm.requests[-1]["n"] == 3


def test_n_is_refused_where_it_cannot_be_served_whole(client, ups, grounded):
    server = grounded("hold")  # a post-policy judges one answer: n answers would pass unjudged
    for stream in (False, True):
        with (
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c,
            pytest.raises(openai.BadRequestError) as err,
        ):
            c.chat.completions.create(model=TEXT_MODEL, messages=_user(), n=2, stream=stream)
        assert err.value.body["param"] == "n"
    assert ups.vllm.request_count == 0


def test_the_unknown_fields_mode_follows_a_hot_reload(bg, upstreams, tmp_path):
    import yaml

    from gateway.settings import load_settings

    upstreams.reset()
    key = mint_key()
    admin_key = secrets.token_hex(32)  # the boot refuses typed and placeholder keys
    admin = {"authorization": f"Bearer {admin_key}"}
    doc = {
        "engines": [
            {
                "name": "text-vllm",
                "kind": "vllm",
                "base_url": upstreams.vllm.base_url,
                "model": "scripted",
                "variant": "fp16",
                "serves": [TEXT_MODEL],
            }
        ],
        "admin": {"api_key": admin_key},
        "tenants": [{"name": "t"}],
        "api_keys": [{"id": key.id, "tenant": "t", "sha256": key.sha256}],
        "audit": {"sqlite_path": str(tmp_path / "audit.db")},
        "logging": {"level": "warning"},
    }
    path = tmp_path / "omnigate.yaml"
    path.write_text(yaml.safe_dump(doc))
    server = GatewayServer(bg, load_settings(path), CollectorRegistry(), config_path=str(path)).start()

    def ask() -> httpx.Response:
        return httpx.post(
            server.url + "/v1/chat/completions",
            timeout=10,
            headers={"authorization": f"Bearer {key.key}"},
            json={"model": TEXT_MODEL, "messages": _user(), "x_trace": "1"},
        )

    def reload() -> None:
        path.write_text(yaml.safe_dump(doc))
        assert httpx.post(server.url + "/admin/config/reload", headers=admin, timeout=10).status_code == 200

    try:
        assert ask().status_code == 400
        doc["requests"] = {"unknown_fields": "drop"}
        reload()
        served = ask()
        assert served.status_code == 200 and served.headers[DROPPED_HEADER] == "x_trace"
        assert "x_trace" not in upstreams.vllm.requests[-1]
        doc["tenants"] = [{"name": "t", "unknown_fields": "refuse"}]  # the tenant's own setting wins
        reload()
        refused = ask()
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "x_trace"
    finally:
        server.stop()
