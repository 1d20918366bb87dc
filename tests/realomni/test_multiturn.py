"""A spoken conversation as the SDKs teach it, against the real vLLM-Omni through the gateway: each answer's
message, as openai-python and openai-node return it (its ``audio`` with ``id``, ``data``, ``expires_at`` and
``transcript``), is appended before the next user turn. Each answer is a well-formed spoken answer, and the
engine receives every earlier answer as the words it said: the conversation's prompt, counted by the engine,
is that of the same conversation sent to it straight with those words as text."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import soundfile as sf

from tests.node import sdk
from tests.realomni.conftest import MODEL

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(2400)]

SYSTEM = {"role": "system", "content": "You are a voice assistant."}
TURNS = ["Say hello.", "Say it again.", "Thanks."]
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
MAX_TOKENS = 3  # the suite's few generated tokens: three speech turns through the three CPU stages


def _wav_frames(b64: str) -> int:
    data, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="int16", always_2d=True)
    assert rate == 24000
    return len(data)


def _well_formed(message: dict, finish: str | None, usage: dict) -> None:
    """One spoken answer as OpenAI shapes it: words, a WAV with an id, a transcript that is no audio."""
    assert finish in ("stop", "length")
    audio = message["audio"]
    assert audio["id"] and audio["expires_at"] > 0
    assert _wav_frames(audio["data"]) > 0
    assert isinstance(audio["transcript"], str) and "UklGR" not in audio["transcript"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS


def _spoken(message: dict) -> str:
    """The text the gateway gives the engine for an assistant turn: its content, else its transcript."""
    return message.get("content") or message["audio"]["transcript"]


def _engine_prompt_tokens(omni, messages: list[dict]) -> int:
    """The prompt tokens vLLM-Omni counts for ``messages`` sent to it straight (text only: the thinker alone,
    which is what reads the prompt)."""
    r = httpx.post(omni.base_url + "/chat/completions", timeout=600, json={
        "model": omni.served_name, "messages": messages, "max_tokens": 1, "temperature": 0,
        "modalities": ["text"]})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _as_text(messages: list[dict]) -> list[dict]:
    return [{"role": "assistant", "content": _spoken(m)} if m["role"] == "assistant" else m for m in messages]


def test_openai_python_appending_each_answer_as_returned(via, omni):
    messages: list = [SYSTEM]
    plain: list[dict] = [SYSTEM]  # the same conversation as dicts, to send straight to the engine
    ids, prompts = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        plain.append({"role": "user", "content": turn})
        resp = via.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **SPEECH
        )
        [choice] = resp.choices
        message = choice.message
        _well_formed(message.model_dump(), choice.finish_reason, resp.usage.model_dump())
        ids.append(message.audio.id)
        prompts.append(resp.usage.prompt_tokens)
        messages.append(message)  # the SDK's own object, audio and all, as every tutorial appends it
        plain.append(message.model_dump(exclude_none=True))
    assert len(set(ids)) == 3
    assert prompts[0] < prompts[1] < prompts[2]  # each turn carried the conversation so far
    # The last request's prompt, as the engine counted it, is the conversation with each answer as its words.
    assert prompts[2] == _engine_prompt_tokens(omni, _as_text(plain[:-1]))


def test_openai_node_appending_each_answer_as_returned(omni_gateway, omni):
    request = {"model": MODEL, "messages": [SYSTEM], "max_tokens": MAX_TOKENS, "temperature": 0, **SPEECH}
    got = sdk.call(omni_gateway.url + "/v1", "converse", request, turns=TURNS, timeout=1800)
    assert "error" not in got, got
    completions = got["completions"]
    assert len(completions) == 3
    for c in completions:
        [choice] = c["choices"]
        _well_formed(choice["message"], choice["finish_reason"], c["usage"])
    assert len({c["choices"][0]["message"]["audio"]["id"] for c in completions}) == 3
    prompts = [c["usage"]["prompt_tokens"] for c in completions]
    assert prompts[0] < prompts[1] < prompts[2]
    conversation = [SYSTEM]
    for turn, c in zip(TURNS, completions, strict=True):
        conversation.append({"role": "user", "content": turn})
        conversation.append(c["choices"][0]["message"])
    assert prompts[2] == _engine_prompt_tokens(omni, _as_text(conversation[:-1]))
