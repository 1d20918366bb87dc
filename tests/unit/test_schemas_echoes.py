"""The request model as the SDKs fill it: assistant turns echoed whole, vLLM's extras, OpenAI's newer fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import InvalidRequest
from core.schemas import ChatCompletionRequest
from gateway.fields import parse_request

# An answer as openai-python hands back ``resp.choices[0].message`` and sends it again once appended.
ECHOED = {
    "role": "assistant",
    "content": "Hello there.",
    "refusal": None,
    "annotations": [],
    "audio": {
        "id": "audio_abc",
        "data": "UklGRg==" * 1000,
        "expires_at": 1_900_000_000,
        "transcript": "Hello there.",
    },
    "function_call": None,
    "tool_calls": None,
    "reasoning_content": "thinking it over",
}


def _body(**more) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}


def test_an_answer_echoed_whole_is_accepted_and_the_engine_gets_text_only():
    req, dropped = parse_request(_body(messages=[{"role": "user", "content": "hi"}, ECHOED]), "refuse")
    assert dropped == []
    turn = req.messages[1]
    assert turn.audio is not None and turn.audio.id == "audio_abc"
    assert "data" not in turn.audio.model_dump()  # the echoed speech is let go of at once
    assert turn.wire() == {"role": "assistant", "content": "Hello there."}


def test_the_reference_shape_audio_id_only():
    req, _ = parse_request(_body(messages=[{"role": "assistant", "audio": {"id": "audio_x"}}]), "refuse")
    assert req.messages[0].content is None and req.messages[0].audio.id == "audio_x"


@pytest.mark.parametrize("key", ["audio", "refusal", "reasoning_content"])
def test_the_echoes_are_for_assistant_turns_only(key):
    value = {"id": "a"} if key == "audio" else "x"
    with pytest.raises(ValidationError, match="only for assistant"):
        ChatCompletionRequest.model_validate(_body(messages=[{"role": "user", "content": "hi", key: value}]))


def test_a_legacy_function_call_that_is_not_null_is_refused():
    turn = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValidationError, match="function_call"):
        ChatCompletionRequest.model_validate(_body(messages=[turn]))


def test_vllm_extras_are_validated_and_named_as_features():
    req = ChatCompletionRequest.model_validate(
        _body(
            min_p=0.05,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[151645],
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            priority=5,
            guided_choice=["yes", "no"],
        )
    )
    assert {
        "min_p",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "priority",
        "guided_choice",
    } <= req.features()
    assert req.structured() == {"choice": ["yes", "no"]}
    structured = ChatCompletionRequest.model_validate(_body(structured_outputs={"json": {"type": "object"}}))
    assert structured.structured() == {"json": {"type": "object"}}


@pytest.mark.parametrize(
    "extra",
    [
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"min_tokens": 10, "max_tokens": 5},
        {"stop_token_ids": [-3]},
        {"stop_token_ids": [2**40]},
        {"stop_token_ids": "7"},
        {"ignore_eos": "yes please"},
        {"priority": -10},  # ahead of every other request: never a client's to take
        {"guided_choice": []},
        {"structured_outputs": {}},
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        {"structured_outputs": {"backend": "xgrammar", "regex": "a"}},
        {"guided_regex": "a+", "guided_choice": ["a"]},
        {"guided_regex": "a+", "response_format": {"type": "json_object"}},
    ],
)
def test_bad_vllm_extras_are_refused(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(_body(**extra))


def test_openai_fields_are_known():
    req = ChatCompletionRequest.model_validate(
        _body(
            metadata={"conversation": "c-1", "app": "voice"},
            safety_identifier="user-hash-1",
            user="legacy-user",
            store=False,
            service_tier="auto",
            prompt_cache_key="conv-1",
        )
    )
    assert req.metadata == {"conversation": "c-1", "app": "voice"}


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k": 3}},
        {"safety_identifier": "x" * 65},
        {"service_tier": "gold"},
    ],
)
def test_openai_fields_past_openais_limits_are_refused(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(_body(**extra))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
@pytest.mark.parametrize("mode", ["refuse", "drop"])
def test_a_field_that_cannot_be_honoured_says_so(extra, param, mode):
    with pytest.raises(InvalidRequest) as caught:
        parse_request(_body(**extra), mode)
    assert caught.value.code == "unsupported_field" and caught.value.param == param


def test_engines_that_cannot_take_vllms_extras_do_not_declare_them():
    from core.schemas import VLLM_EXTRA_FIELDS
    from engines.adapters.litellm_engine import LiteLLMEngine
    from engines.adapters.local import LocalEngine
    from engines.adapters.openai_compat import OpenAICompatEngine
    from engines.adapters.settings import EngineConfig
    from tests.unit.test_local_engine import _config

    extras = set(VLLM_EXTRA_FIELDS)

    def hosted(model: str) -> set[str]:
        cfg = EngineConfig(name="h", kind="litellm", model=model, serves=["m"], api_key="sk-x")
        return set(LiteLLMEngine(cfg).capabilities.features)

    assert not extras & set(LocalEngine(_config()).capabilities.features)
    assert not extras & hosted("openai/gpt-4o-mini")
    assert extras <= hosted("hosted_vllm/some-model")
    vllm = EngineConfig(name="v", kind="vllm", base_url="http://127.0.0.1:1/v1", model="x", serves=["m"])
    assert extras <= set(OpenAICompatEngine(vllm).capabilities.features)
