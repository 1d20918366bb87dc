"""vLLM-Omni as it is today (WIRE.md), one test per shape: the official openai SDK and raw HTTP through a real
gateway to the scripted upstream speaking vLLM-Omni 0.30.0 (and its other builds' variants) over real sockets."""

from __future__ import annotations

import base64
import io
import sqlite3

import httpx
import openai
import orjson
import pytest
import soundfile as sf

from tests.conftest import OMNI_MODEL, gateway_settings
from tests.harness import GatewayServer
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

SAID = "One two three four five six seven eight."  # eight text pieces, one token each
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


def _user(text: str = "Say something.") -> list[dict]:
    return [{"role": "user", "content": text}]


def _set(ups, **attrs) -> None:
    def apply() -> None:
        for k, v in attrs.items():
            setattr(ups.omni_a, k, v)
            setattr(ups.omni_b, k, v)

    ups.bg.call(apply)


def _stream(client, **kw):
    """Text, WAV bytes, finish_reason and usage of one streamed answer, read through the SDK."""
    text, audio, transcript, finish, usage = [], b"", [], None, None
    for chunk in client.chat.completions.create(model=OMNI_MODEL, messages=_user(), stream=True,
                                                stream_options={"include_usage": True}, **kw):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0
            text.append(choice.delta.content or "")
            piece = getattr(choice.delta, "audio", None)
            if piece:
                audio += base64.b64decode(piece.data) if piece.data else b""
                transcript.append(piece.transcript or "")
            finish = choice.finish_reason or finish
    return "".join(text), audio, "".join(transcript), finish, usage


def _frames(gateway, body: dict) -> list[dict]:
    """The raw SSE events a client receives."""
    out = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


# -- finish_reason: the stop rides on the last audio chunk ---------------------------------------------------


def test_speech_cut_at_max_tokens_finishes_length(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=3)
    _, audio, transcript, finish, usage = _stream(client, max_tokens=3, **SPEECH)
    assert transcript == "One two three "
    assert (
        finish == "length"
    )  # the engine's own stream says "stop" on its last audio chunk, nothing on the text
    assert usage.completion_tokens == 3 and audio


def test_speech_that_ends_by_itself_finishes_stop(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=3)
    _, _, transcript, finish, _ = _stream(client, max_tokens=50, **SPEECH)
    assert transcript == SAID and finish == "stop"


@pytest.mark.parametrize("cap, expected", [(3, "length"), (50, "stop")])
def test_a_text_only_answer_keeps_its_own_finish_reason(client, ups, cap, expected):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    text, audio, _, finish, _ = _stream(client, max_tokens=cap, modalities=["text"])
    assert finish == expected and not audio and text


def test_a_build_with_a_bare_closing_chunk_still_finishes_right(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=2, omni_bare_finish=True)
    assert _stream(client, max_tokens=3, **SPEECH)[3] == "length"
    assert _stream(client, **SPEECH)[3] == "stop"


# -- audio pieces: a WAV file each, or a header on the first only, with or without metadata ------------------


@pytest.mark.parametrize("headers", ["every", "first"])
@pytest.mark.parametrize("metadata", [True, False])
@pytest.mark.parametrize("rate", [24000, 16000])
def test_streamed_speech_is_one_valid_wav_whatever_the_build(client, ups, headers, metadata, rate):
    ups.omni_a.default = Script(flavour="omni", text="Hello there.", audio_chunks=4, sample_rate=rate,
                                omni_wav_headers=headers, omni_audio_metadata=metadata)  # fmt: skip
    text, audio, transcript, _, _ = _stream(client, **SPEECH)
    assert text == "" and transcript == "Hello there."  # base64 audio never arrives as text
    assert audio.count(b"RIFF") == 1  # the engine's per-piece headers do not reach the client
    data, got_rate = sf.read(io.BytesIO(audio), dtype="int16")
    assert got_rate == rate and len(data) == 4 * int(rate * 0.2)
    assert abs(data).max() > 1000


def test_pcm16_clients_get_pcm_while_the_engine_is_asked_for_wav(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=3, sample_rate=16000)
    _, pcm, _, _, usage = _stream(
        client, modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16"}
    )
    assert ups.omni_a.requests[-1]["audio"]["format"] == "wav"
    assert not pcm.startswith(b"RIFF") and len(pcm) == 3 * int(16000 * 0.2) * 2
    # The rate came from the engine's WAV header, not a guess: 0.6 s of 16 kHz speech.
    assert usage.model_extra["output_audio_seconds"] == pytest.approx(0.6)


# -- non-streamed: one merged choice (0.30.0) or two choices both index 0 ------------------------------------


@pytest.mark.parametrize("shape", ["merged", "split", "split_audio_first"])
def test_non_streamed_speech_in_any_choice_shape_is_one_choice(client, ups, shape):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=4, omni_choices=shape)
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), **SPEECH)
    [choice] = resp.choices
    assert choice.message.content == SAID and choice.finish_reason == "stop"
    assert choice.message.audio.transcript == SAID
    data, rate = sf.read(io.BytesIO(base64.b64decode(choice.message.audio.data)), dtype="int16")
    assert rate == 24000 and len(data) == 4 * int(24000 * 0.2)


def test_non_streamed_speech_cut_at_max_tokens_finishes_length(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=2)
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), max_tokens=3, **SPEECH)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content == "One two three "


def test_non_streamed_audio_only_answer(client, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=2)
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), modalities=["audio"],
                                          audio={"voice": "Ethan", "format": "wav"})  # fmt: skip
    data, rate = sf.read(io.BytesIO(base64.b64decode(resp.choices[0].message.audio.data)), dtype="int16")
    assert rate == 24000 and len(data) == 2 * int(24000 * 0.2)


# -- the voice ------------------------------------------------------------------------------------------------


def test_the_voice_goes_top_level_and_lowercased(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=1)
    _stream(client, modalities=["text", "audio"], audio={"voice": "CHELSIE", "format": "wav"})
    sent = ups.omni_a.requests[-1]
    assert sent["voice"] == sent["speaker"] == "chelsie"


@pytest.mark.parametrize("stream", [True, False])
def test_an_unknown_voice_refused_by_the_engine_is_an_openai_400(client, ups, stream):
    with pytest.raises(openai.BadRequestError) as info:
        r = client.chat.completions.create(
            model=OMNI_MODEL,
            messages=_user(),
            stream=stream,
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
    assert ups.omni_b.request_count == 0  # the engine's refusal is not failed over


@pytest.fixture(scope="module")
def voiced(bg, upstreams, tmp_path_factory):
    """A second gateway on the same upstreams whose vLLM-Omni engines list their voices; its audit in SQLite."""
    db = tmp_path_factory.mktemp("omni-audit") / "audit.db"
    base = gateway_settings(upstreams, audit={"sqlite_path": str(db)})
    engines = [e.model_copy(update={"voices": ["Aiden", "Chelsie", "Ethan"]}) if e.kind == "vllm-omni" else e
               for e in base.engines]  # fmt: skip
    server = GatewayServer(bg, base.model_copy(update={"engines": engines})).start()
    server.db = db
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_an_unknown_voice_is_refused_before_any_engine_work(voiced, ups, stream):
    body = {"model": OMNI_MODEL, "messages": _user(), "stream": stream, "modalities": ["text", "audio"],
            "audio": {"voice": "Cherry", "format": "wav"}}  # fmt: skip
    resp = httpx.post(voiced.url + "/v1/chat/completions", json=body, timeout=20)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "audio.voice" and err["code"] == "invalid_voice" and "aiden" in err["message"]
    assert ups.omni_a.request_count == ups.omni_b.request_count == 0
    ok = httpx.post(
        voiced.url + "/v1/chat/completions", json={**body, "audio": {"voice": "Ethan"}}, timeout=20
    )
    assert ok.status_code == 200 and ups.omni_a.request_count == 1


# -- the engine's other refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_prompt_over_the_context_is_a_400_though_vllm_omni_answers_500(client, ups, stream):
    # A real vLLM-Omni 0.30.0 answers an over-long prompt with vLLM's message under HTTP 500 ("Internal Server
    # Error"): the client's request is what is wrong, so it gets OpenAI's 400, and no other engine is tried.
    ups.omni_a.default = ups.omni_b.default = Script(flavour="omni", fault="400_before_headers")
    with pytest.raises(openai.BadRequestError) as info:
        r = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), stream=stream, max_tokens=4)
        list(r) if stream else None
    err = info.value.body
    assert info.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    assert err["param"] == "messages" and "Internal Server Error" not in err["message"]
    assert ups.omni_b.request_count == 0  # a refusal, not a failure to fail over from


def test_other_vllm_omni_500s_stay_engine_failures(client, ups):
    ups.omni_a.default = ups.omni_b.default = Script(flavour="omni", fault="500_before_headers")
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=OMNI_MODEL, messages=_user(), max_tokens=4)
    assert info.value.status_code >= 500


# -- what never reaches a client ------------------------------------------------------------------------------


def test_vllm_extras_and_omni_tags_never_reach_a_client(gateway, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=2)
    body = {"model": OMNI_MODEL, "messages": _user(), "stream": True, "stream_options": {"include_usage": True},
            **SPEECH}  # fmt: skip
    frames = _frames(gateway, body)
    assert frames
    for f in frames:
        assert not {"metrics", "prompt_token_ids", "modality"} & set(f)
        for c in f["choices"]:
            assert not {"token_ids", "stop_reason", "audio_metadata"} & set(c)
    whole = httpx.post(
        gateway.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=20
    ).json()
    assert not {"metrics", "prompt_token_ids", "modality"} & set(whole)
    assert not {"token_ids", "stop_reason", "audio_metadata"} & set(whole["choices"][0])


# -- formats: only what can be served -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_aac_is_refused_before_any_engine_work(client, ups, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=OMNI_MODEL,
            messages=_user(),
            stream=stream,
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "aac"},
        )
    assert info.value.body["param"] == "audio.format"
    assert ups.omni_a.request_count == ups.omni_b.request_count == 0


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm16"])
def test_every_accepted_non_streamed_format_is_served(client, ups, fmt):
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=3)
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), modalities=["text", "audio"],
                                          audio={"voice": "Ethan", "format": fmt})  # fmt: skip
    raw = base64.b64decode(resp.choices[0].message.audio.data)
    if fmt == "pcm16":
        assert len(raw) == 3 * int(24000 * 0.2) * 2
    else:
        data, rate = sf.read(io.BytesIO(raw), dtype="int16")
        assert rate in (24000, 48000) and len(data) >= 0.5 * rate  # opus resamples to 48 kHz


@pytest.mark.parametrize("rate", [22050, 44100])
def test_opus_from_a_talker_at_a_rate_opus_does_not_code(client, ups, rate):
    """A talker at 22.05 or 44.1 kHz asked for opus: served at 48 kHz, not a 500."""
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=3, sample_rate=rate)
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), modalities=["text", "audio"],
                                          audio={"voice": "Ethan", "format": "opus"})  # fmt: skip
    data, got = sf.read(io.BytesIO(base64.b64decode(resp.choices[0].message.audio.data)), dtype="int16")
    assert got == 48000 and abs(len(data) / 48000 - 0.6) < 0.03


# -- speech is metered in seconds -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_speech_is_metered_in_seconds(gateway, client, ups, stream):
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=5)  # 5 x 0.2 s
    labels = {"engine": "omni-int4", "variant": "int4"}
    before = gateway.registry.get_sample_value("omnigate_audio_output_seconds_total", labels) or 0.0
    if stream:
        usage = _stream(client, **SPEECH)[4]
    else:
        usage = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), **SPEECH).usage
    assert usage.completion_tokens == 1  # audio adds no tokens ...
    assert usage.model_extra["output_audio_seconds"] == pytest.approx(1.0)  # ... so it is counted in seconds
    after = gateway.registry.get_sample_value("omnigate_audio_output_seconds_total", labels)
    assert after - before == pytest.approx(1.0)


def test_the_audit_record_meters_speech_in_seconds(voiced, ups):
    ups.omni_a.default = Script(flavour="omni", text="Hi.", audio_chunks=3)  # 3 x 0.2 s
    body = {"model": OMNI_MODEL, "messages": _user(), "stream": True, **SPEECH}
    assert len(_frames(voiced, body)) > 1

    def usages() -> list[dict]:
        conn = sqlite3.connect(voiced.db)
        try:
            rows = conn.execute("SELECT data FROM audit_log WHERE kind = 'request'").fetchall()
        finally:
            conn.close()
        return [orjson.loads(r[0])["payload"]["usage"] for r in rows]

    # The record is committed before the stream's last frame goes out.
    assert {"prompt_tokens": 11, "completion_tokens": 1, "audio_seconds": 0.6} in usages()


# -- non-streamed: the text stage's message is vLLM's, tool calls and reasoning included ----------------------

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize("shape", ["merged", "split"])
def test_non_streamed_tool_calls_and_reasoning_reach_the_client(client, ups, shape):
    ups.omni_a.default = Script(
        flavour="omni",
        text="",
        audio_chunks=0,
        omni_choices=shape,
        tool_calls=[{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
        reasoning="The user wants the weather.",
    )
    resp = client.chat.completions.create(
        model=OMNI_MODEL, messages=_user("Weather in Paris?"), tools=WEATHER
    )
    [choice] = resp.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert orjson.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id
    extra = choice.message.model_extra or {}
    assert extra.get("reasoning_content") == "The user wants the weather."
