"""vLLM's own sampling extras, sent as its users send them (openai-python's ``extra_body``), through the gateway
to the real vLLM: each reaches the engine and takes effect there, and the answer is the one vLLM gives the same
request straight. What the gateway accepts for a ``vllm`` engine the real vLLM takes; a bad value is the
gateway's 400, before the engine sees anything. And the engine's log carries the gateway's request id."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.realvllm.conftest import MODEL

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(1800)]

DIRECT_MODEL = "smollm2"
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
SHORT = [{"role": "user", "content": "Reply with one word: is water wet?"}]


def _ask(client: openai.OpenAI, model: str, extra: dict | None = None, **kw):
    kw.setdefault("messages", PROMPT)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, extra_body=extra, **kw)


def _both(via, direct, extra: dict, direct_extra: dict | None = None, **kw):
    return _ask(via, MODEL, extra, **kw), _ask(direct, DIRECT_MODEL, direct_extra or extra, **kw)


def _token_ids(vllm, text: str) -> list[int]:
    r = httpx.post(vllm.root + "/tokenize", timeout=30,
                   json={"model": DIRECT_MODEL, "prompt": text, "add_special_tokens": False})  # fmt: skip
    r.raise_for_status()
    return r.json()["tokens"]


def test_min_tokens_holds_off_the_end_as_in_vllm(via, direct):
    short = _ask(direct, DIRECT_MODEL, messages=SHORT, max_tokens=40)
    assert short.choices[0].finish_reason == "stop"  # the model ends this answer by itself ...
    floor = short.usage.completion_tokens + 6
    got, want = _both(via, direct, {"min_tokens": floor}, messages=SHORT, max_tokens=floor + 30)
    assert got.usage.completion_tokens >= floor  # ... and min_tokens keeps it going past its end
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_ignore_eos_runs_to_max_tokens_as_in_vllm(via, direct):
    short = _ask(direct, DIRECT_MODEL, messages=SHORT, max_tokens=40)
    cap = short.usage.completion_tokens + 8
    got, want = _both(via, direct, {"ignore_eos": True}, messages=SHORT, max_tokens=cap)
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == cap
    assert got.choices[0].message.content == want.choices[0].message.content


def test_stop_token_ids_end_the_answer_at_that_token(via, direct, vllm):
    whole = _ask(direct, DIRECT_MODEL, max_tokens=24)
    text = whole.choices[0].message.content
    ids = _token_ids(vllm, text)
    stop = ids[len(ids) // 2]
    got, want = _both(via, direct, {"stop_token_ids": [stop]}, max_tokens=24)
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < whole.usage.completion_tokens
    assert got.choices[0].message.content == want.choices[0].message.content
    assert text.startswith(got.choices[0].message.content.strip()[:8])


@pytest.mark.parametrize(
    "extra",
    [{"guided_choice": ["purple", "turquoise"]}, {"structured_outputs": {"choice": ["purple", "turquoise"]}}],
    ids=["guided_choice", "structured_outputs"],
)
def test_a_choice_constraint_answers_one_of_the_choices(via, direct, extra):
    got, want = _both(via, direct, extra, {"structured_outputs": {"choice": ["purple", "turquoise"]}},
                      max_tokens=12)  # fmt: skip
    assert got.choices[0].message.content in ("purple", "turquoise")
    assert got.choices[0].message.content == want.choices[0].message.content


def test_guided_regex_constrains_the_answer(via):
    got = _ask(via, MODEL, {"guided_regex": "[0-9]{3}"}, max_tokens=12)
    assert len(got.choices[0].message.content) == 3 and got.choices[0].message.content.isdigit()


@pytest.mark.parametrize("include", [True, False])
def test_include_stop_str_in_output_keeps_the_stop_string(via, direct, include):
    whole = _ask(direct, DIRECT_MODEL, max_tokens=24).choices[0].message.content
    word = whole.split()[len(whole.split()) // 2].strip(".,:;!?*")
    assert word
    got, want = _both(via, direct, {"include_stop_str_in_output": include}, max_tokens=24, stop=[word])
    content = got.choices[0].message.content
    assert content == want.choices[0].message.content
    assert content.endswith(word) is include


@pytest.mark.parametrize(
    "extra",
    [{"min_p": 0.2}, {"skip_special_tokens": False}, {"priority": 0}, {"priority": 5}],
    ids=["min_p", "skip_special_tokens", "priority-0", "priority-5"],
)
def test_what_the_gateway_accepts_the_real_vllm_serves(via, direct, extra):
    got = _ask(via, MODEL, extra, max_tokens=8, temperature=0.7, seed=7)
    assert got.choices[0].message.content and got.usage.completion_tokens <= 8
    want = _ask(direct, DIRECT_MODEL, extra if "priority" not in extra else None, max_tokens=8, temperature=0.7,
                seed=7)  # fmt: skip
    assert got.choices[0].message.content == want.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_p": 2}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids.0"),
        ({"ignore_eos": "sometimes"}, "ignore_eos"),
        ({"priority": -1}, "priority"),
        ({"guided_choice": ["a"], "guided_regex": "a+"}, None),
        ({"structured_outputs": {"choice": ["a"], "regex": "a+"}}, None),
    ],
)
def test_a_bad_extra_is_the_gateways_400_before_the_engine(via, vllm, extra, param):
    before = vllm.metric("vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as info:
        _ask(via, MODEL, extra, max_tokens=4)
    body = info.value.body
    assert info.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert set(body) >= {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param
    assert vllm.metric("vllm:prompt_tokens_total") == before  # vLLM never saw it


def test_the_engine_log_carries_the_gateways_request_id(real_gateway, vllm):
    r = httpx.post(real_gateway.url + "/v1/chat/completions", timeout=180,
                   json={"model": MODEL, "messages": PROMPT, "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 30
    while rid not in vllm.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [line for line in vllm.log.read_text(errors="replace").splitlines() if rid in line]
    assert any(f"chatcmpl-{rid}" in line for line in lines), vllm.tail()


ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
TAG = (
    '{"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}],'
    ' "triggers": ["<a>"]}'
)


@pytest.mark.parametrize(
    "structured",
    [
        {"json": ANSWER},
        {"json": ANSWER, "disable_any_whitespace": True},
        {"json": ANSWER, "disable_additional_properties": True},
        {"json": ANSWER, "whitespace_pattern": "[ ]?"},
        {"json_object": True},
        {"grammar": 'root ::= "yes" | "no"'},
        {"regex": "[a-z]{4}"},
        {"structural_tag": TAG},
    ],
    ids=[
        "json",
        "no-whitespace",
        "no-additional",
        "whitespace-pattern",
        "json_object",
        "grammar",
        "regex",
        "tag",
    ],
)
def test_every_structured_output_the_gateway_accepts_the_real_vllm_serves(via, structured):
    got = _ask(via, MODEL, {"structured_outputs": structured}, max_tokens=32)
    content = got.choices[0].message.content
    assert got.choices[0].finish_reason in ("stop", "length")
    if "grammar" in structured:
        assert content in ("yes", "no")
    if "regex" in structured:
        assert len(content) == 4 and content.isalpha()
