"""Contract tests against a real vLLM-Omni server (its PyPI release on the CPU, Qwen3-Omni's three stages):
each request goes through the gateway with the official openai SDK, and where the engine's own answer is the
yardstick the same request also goes straight to vLLM-Omni. The model's weights are random, so its words mean
nothing; what is asserted is the shape: speech, text, voices, finish reasons, usage, errors and metrics."""

from __future__ import annotations

import base64
import binascii
import io
import sqlite3
import time

import httpx
import openai
import orjson
import pytest
import soundfile as sf

from tests.realomni.conftest import ENGINE, MODEL, UNCHECKED

# The first test also pays for preparing vLLM-Omni (minutes on a fresh machine) and starting it (3-4 minutes).
pytestmark = [pytest.mark.realomni, pytest.mark.timeout(2400)]

PROMPT = [{"role": "user", "content": "Say hello."}]
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


def streamed(stream) -> tuple[str, bytes, str | None, object]:
    """The words, WAV bytes, finish_reason and usage of one answer streamed through the gateway, as the SDK
    sees it. With speech the words are the audio's transcript (OpenAI's shape), without it the text."""
    text, transcript, audio, finish, usage = [], [], b"", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index == 0
            text.append(c.delta.content or "")
            piece = getattr(c.delta, "audio", None)
            if piece:
                audio += base64.b64decode(piece.data) if piece.data else b""
                transcript.append(piece.transcript or "")
            finish = c.finish_reason or finish
    if audio:
        assert not "".join(text)  # with speech nothing arrives as text: the words are the transcript
        _not_base64_audio("".join(transcript))
        return "".join(transcript), audio, finish, usage
    return "".join(text), audio, finish, usage


def direct_stream(omni, body: dict) -> list[dict]:
    """vLLM-Omni's own chunks for ``body`` (raw JSON: its ``modality`` tag is not part of the SDK's types)."""
    out = []
    with httpx.stream(
        "POST", omni.base_url + "/chat/completions", json={**body, "stream": True}, timeout=600
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


def _text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("modality") == "text" and c["choices"])  # fmt: skip


def _wav(raw: bytes) -> tuple[int, int]:
    data, rate = sf.read(io.BytesIO(raw), dtype="int16", always_2d=True)
    return len(data), rate


def _not_base64_audio(text: str) -> None:
    assert "UklGR" not in text  # base64 of "RIFF": a WAV file never arrives as text
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return
    assert not raw.startswith(b"RIFF")


def _stage_counter(omni, name: str, stage: str) -> float:
    return omni.metric(name, stage=stage)


# -- speech ----------------------------------------------------------------------------------------------------


def test_streamed_speech_is_one_valid_wav_and_the_text_is_the_engines(via, omni):
    words, audio, finish, usage = streamed(via.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, **SPEECH))  # fmt: skip
    assert (
        audio.startswith(b"RIFF") and audio.count(b"RIFF") == 1
    )  # one file, not the engine's per-piece files
    frames, rate = _wav(audio)
    assert rate == 24000 and frames > 0
    assert finish in ("stop", "length")
    assert usage.completion_tokens <= 6  # speech adds no tokens ...
    assert usage.model_extra["output_audio_seconds"] == pytest.approx(
        frames / rate, abs=0.01
    )  # ... but seconds
    # The engine's own stream for the same greedy request: the same words, and its audio as base64 text.
    chunks = direct_stream(omni, {"model": omni.served_name, "messages": PROMPT, "max_tokens": 6,
                                  "temperature": 0, "modalities": ["text", "audio"], "voice": "ethan"})  # fmt: skip
    assert _text_of(chunks) == words and words
    assert any(c.get("modality") == "audio" for c in chunks)


def test_speech_cut_at_max_tokens_reaches_the_client_as_length(via, omni):
    cap = 3
    _, audio, finish, usage = streamed(via.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=cap, temperature=0, stream=True,
        stream_options={"include_usage": True}, **SPEECH))  # fmt: skip
    assert usage.completion_tokens == cap and audio
    assert finish == "length"
    # The engine itself puts "stop" on its last audio chunk and nothing on the text's last one.
    chunks = direct_stream(omni, {"model": omni.served_name, "messages": PROMPT, "max_tokens": cap,
                                  "temperature": 0, "modalities": ["text", "audio"], "voice": "ethan"})  # fmt: skip
    finishes = [(c.get("modality"), c["choices"][0].get("finish_reason")) for c in chunks if c["choices"]]
    assert ("text", "length") not in finishes


def test_non_streamed_speech_is_one_choice_with_text_and_wav(via):
    resp = via.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=5, temperature=0, **SPEECH)
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    _not_base64_audio(choice.message.content)
    frames, rate = _wav(base64.b64decode(choice.message.audio.data))
    assert rate == 24000 and frames > 0
    assert resp.usage.completion_tokens <= 5
    assert resp.usage.model_extra["output_audio_seconds"] == pytest.approx(frames / rate, abs=0.01)


def test_speech_seconds_reach_the_metrics_and_the_audit_record(omni_gateway, via):
    labels = {"engine": ENGINE, "variant": "bf16"}
    before = omni_gateway.registry.get_sample_value("omnigate_audio_output_seconds_total", labels) or 0.0
    resp = via.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, temperature=0, **SPEECH)
    frames, rate = _wav(base64.b64decode(resp.choices[0].message.audio.data))
    after = omni_gateway.registry.get_sample_value("omnigate_audio_output_seconds_total", labels)
    assert after - before == pytest.approx(frames / rate, abs=0.01)
    conn = sqlite3.connect(omni_gateway.db)
    try:
        rows = conn.execute("SELECT data FROM audit_log WHERE kind = 'request'").fetchall()
    finally:
        conn.close()
    usages = [orjson.loads(r[0])["payload"]["usage"] for r in rows]
    assert any(u.get("audio_seconds") == pytest.approx(frames / rate, abs=0.01) and u["completion_tokens"] <= 2
               for u in usages)  # fmt: skip


# -- text only: the thinker alone (the shedding lever) ---------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_text_only_stops_at_the_thinker(via, omni, stream):
    talker_before = _stage_counter(omni, "vllm:request_success_total", "1")
    kw = {"model": MODEL, "messages": PROMPT, "max_tokens": 4, "temperature": 0, "modalities": ["text"]}
    if stream:
        text, audio, finish, usage = streamed(via.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw))  # fmt: skip
    else:
        resp = via.chat.completions.create(**kw)
        text, finish, usage = resp.choices[0].message.content, resp.choices[0].finish_reason, resp.usage
        audio = resp.choices[0].message.audio
    assert not audio
    assert finish == "length" and usage.completion_tokens == 4  # a text-only answer keeps its own stop
    _not_base64_audio(text)
    time.sleep(1)  # the stages publish their counters a moment after a request ends
    assert _stage_counter(omni, "vllm:request_success_total", "1") == talker_before  # the talker never ran


def test_load_shedding_serves_speech_requests_text_only_from_the_thinker(shedding_gateway, omni):
    talker_before = _stage_counter(omni, "vllm:request_success_total", "1")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4, "temperature": 0, **SPEECH}
    resp = httpx.post(shedding_gateway.url + "/v1/chat/completions", json=body, timeout=600)
    assert resp.status_code == 200 and "load-text-only" in resp.headers["x-omnigate-degraded"]
    [choice] = resp.json()["choices"]
    assert choice["message"].get("audio") is None and choice["message"]["content"]
    time.sleep(1)
    assert _stage_counter(omni, "vllm:request_success_total", "1") == talker_before  # no speech was made


# -- voices ----------------------------------------------------------------------------------------------------


def test_a_valid_voice_speaks(via):
    resp = via.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=3,
        temperature=0,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
    )
    assert _wav(base64.b64decode(resp.choices[0].message.audio.data))[0] > 0


@pytest.mark.parametrize("stream", [True, False])
def test_an_unknown_voice_is_the_gateways_400_before_any_engine_work(via, omni, stream):
    prompts_before = _stage_counter(omni, "vllm:prompt_tokens_total", "0")
    with pytest.raises(openai.BadRequestError) as info:
        r = via.chat.completions.create(model=MODEL, messages=PROMPT, stream=stream, modalities=["text", "audio"],
                                        audio={"voice": "Nobody", "format": "wav"})  # fmt: skip
        list(r) if stream else None
    err = info.value.body
    assert err["param"] == "audio.voice" and err["code"] == "invalid_voice" and "aiden" in err["message"]
    time.sleep(1)
    assert _stage_counter(omni, "vllm:prompt_tokens_total", "0") == prompts_before  # the thinker saw nothing


@pytest.mark.parametrize("stream", [True, False])
def test_the_engines_own_voice_refusal_is_an_openai_400(via, omni, stream):
    # Straight to the engine: its own 400 JSON, also for a stream, before any chunk.
    raw = httpx.post(omni.base_url + "/chat/completions", timeout=60, json={
        "model": omni.served_name, "messages": PROMPT, "stream": stream, "modalities": ["text", "audio"],
        "voice": "nobody"})  # fmt: skip
    assert raw.status_code == 400 and "Invalid speaker" in raw.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        # max_tokens as a client sets it: without one the gateway's speech cap (2,048) is the whole context
        # of this test engine, and vLLM-Omni checks the context before the speaker.
        r = via.chat.completions.create(
            model=UNCHECKED,
            messages=PROMPT,
            stream=stream,
            max_tokens=8,
            modalities=["text", "audio"],
            audio={"voice": "Nobody", "format": "wav"},
        )
        list(r) if stream else None
    err = info.value.body
    assert info.value.status_code == 400
    assert (
        err["type"] == "invalid_request_error"
        and err["param"] == "audio.voice"
        and err["code"] == "invalid_voice"
    )
    assert "aiden, chelsie, ethan" in err["message"] and "BadRequestError" not in err["message"]


# -- the engine's other 400s -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_prompt_over_the_engines_context_is_an_openai_400(via, stream):
    long = [{"role": "user", "content": "word " * 600}]  # one token a byte: over the stage's 2048
    with pytest.raises(openai.BadRequestError) as info:
        r = via.chat.completions.create(model=UNCHECKED, messages=long, stream=stream, max_tokens=4,
                                        modalities=["text"])  # fmt: skip
        list(r) if stream else None
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert set(err) >= {"message", "type", "param", "code"}


# -- metrics ---------------------------------------------------------------------------------------------------


def test_the_real_per_stage_metrics_are_read_for_the_thinker(omni_gateway, omni, bg):
    text = httpx.get(omni.root + "/metrics", timeout=10).text
    # Real vLLM-Omni 0.30.0 labels vLLM's series by stage id, one set per stage (the shape the telemetry reads).
    assert "vllm:num_requests_running{" in text and 'stage="0"' in text and 'stage="2"' in text
    telemetry = omni_gateway.services.controller.telemetry
    via_one = {"model": MODEL, "messages": PROMPT, "max_tokens": 2, **SPEECH}
    httpx.post(omni_gateway.url + "/v1/chat/completions", json=via_one, timeout=600).raise_for_status()
    deadline = time.monotonic() + 30
    while True:
        bg.run(telemetry.collect_once())
        after = telemetry.latest(ENGINE)
        if (
            after.get("engine_ttft_p99", 0) > 0 and after.get("requests_running") == 0
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert after["requests_running"] == 0, after
    assert after.get("engine_ttft_p99", 0) > 0, after  # the thinker's first token, from its histogram
    assert omni.metric("vllm:time_to_first_token_seconds_count", stage="0") > 0
