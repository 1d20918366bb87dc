"""The official openai SDK against a real uvicorn server and scripted engines over real sockets."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import soundfile as sf

from tests.conftest import LITELLM_MODEL, OMNI_MODEL, TEXT_MODEL
from tests.harness import wait_until
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)


def _user(text: str = "Say something.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_text_streaming_with_usage(client, ups):
    ups.vllm.default = Script(flavour="vllm", text="One two three four five.")
    stream = client.chat.completions.create(
        model=TEXT_MODEL, messages=_user(), stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == "One two three four five."
    assert len(pieces) == 5
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_speech_streaming_reassembles_into_valid_wav(client, ups):
    said = "The quick brown fox jumps over the lazy dog."
    ups.omni_a.default = Script(flavour="omni", text=said, audio_chunks=6)
    stream = client.chat.completions.create(
        model=OMNI_MODEL,
        messages=_user("Read me a pangram."),
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        stream=True,
    )
    audio, transcript, contents, choices_seen = b"", [], [], set()
    for chunk in stream:
        for choice in chunk.choices:
            choices_seen.add(choice.index)
            if choice.delta.content:
                contents.append(choice.delta.content)
            piece = getattr(choice.delta, "audio", None)
            if piece:
                if piece.data:
                    audio += base64.b64decode(piece.data)
                if piece.transcript:
                    transcript.append(piece.transcript)
    assert choices_seen == {0}
    assert contents == []  # base64 audio never arrives as text
    assert "".join(transcript) == said
    data, rate = sf.read(io.BytesIO(audio), dtype="int16")
    assert rate == 24000
    assert len(data) == 6 * int(24000 * 0.2)
    assert abs(data).max() > 1000  # a real signal, not silence
    sent = ups.omni_a.requests[-1]
    assert sent["voice"] == sent["speaker"] == "ethan"  # top level, lowercased: vLLM-Omni ignores audio.voice
    assert sent["modalities"] == ["text", "audio"]


def test_speech_pcm16_streaming(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Short.", audio_chunks=3)
    stream = client.chat.completions.create(
        model=OMNI_MODEL,
        messages=_user(),
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "pcm16"},
        stream=True,
    )
    pcm = b"".join(
        base64.b64decode(c.choices[0].delta.audio.data)
        for c in stream
        if c.choices and getattr(c.choices[0].delta, "audio", None) and c.choices[0].delta.audio.data
    )
    assert not pcm.startswith(b"RIFF")
    assert len(pcm) == 3 * int(24000 * 0.2) * 2


def test_non_streaming_two_choices_become_one(client, ups):
    said = "Two choices upstream, one for the client."
    ups.omni_a.default = Script(flavour="omni", text=said, audio_chunks=4)
    resp = client.chat.completions.create(
        model=OMNI_MODEL,
        messages=_user(),
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
    )
    assert len(resp.choices) == 1
    msg = resp.choices[0].message
    assert msg.content == said
    assert msg.audio is not None and msg.audio.transcript == said
    data, rate = sf.read(io.BytesIO(base64.b64decode(msg.audio.data)), dtype="int16")
    assert rate == 24000 and len(data) == 4 * int(24000 * 0.2)
    assert resp.usage.completion_tokens > 0


def test_non_streaming_text(client, ups):
    ups.vllm.default = Script(flavour="vllm", text="Plain answer.")
    resp = client.chat.completions.create(model=TEXT_MODEL, messages=_user())
    assert resp.choices[0].message.content == "Plain answer."
    assert resp.choices[0].finish_reason == "stop"


def test_unknown_model_is_404_in_openai_shape(client, ups):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=_user())
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error"


def test_validation_error_names_the_field(client, ups):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TEXT_MODEL, messages=[])
    assert info.value.status_code == 400
    assert info.value.body["param"] == "messages"


def test_engine_rejection_passes_as_4xx_and_engine_outage_as_503(client, ups):
    ups.vllm.enqueue(Script(flavour="vllm", fault="503_retry_after"))
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=TEXT_MODEL, messages=_user())
    assert info.value.status_code == 503
    assert info.value.body["code"] == "engine_unavailable"


def test_failover_before_first_byte(client, ups, gateway):
    ups.omni_a.enqueue(Script(flavour="omni", fault="500_before_headers"))
    stream = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == Script().text
    assert ups.omni_a.errors == 1
    assert ups.omni_b.completed == 1


def test_failover_on_reset_before_first_byte_non_streaming(client, ups):
    ups.omni_a.enqueue(Script(flavour="omni", fault="reset_before_first_byte"))
    resp = client.chat.completions.create(model=OMNI_MODEL, messages=_user())
    assert resp.choices[0].message.content == Script().text
    assert ups.omni_b.completed == 1


def test_slow_first_byte_times_out_and_fails_over(client, ups):
    ups.omni_a.enqueue(Script(flavour="omni", fault="hang_before_first_byte"))
    stream = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == Script().text
    assert ups.omni_b.completed == 1
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=3)  # the hung request was closed, not leaked


def test_client_disconnect_aborts_upstream(gateway, ups):
    ups.omni_a.default = Script(flavour="omni", chunk_delay_s=0.3)
    body = {"model": OMNI_MODEL, "messages": _user(), "stream": True}
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", gateway.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # one chunk in, then leave
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=3)
    assert ups.omni_a.completed == 0
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'omnigate_requests_total{model="qwen3-omni-flash",outcome="cancelled"}' in metrics


def test_mid_stream_failure_is_an_error_frame_then_done(gateway, ups):
    ups.omni_a.enqueue(Script(flavour="omni", fault="reset_mid_stream", fault_after_chunks=2))
    body = {"model": OMNI_MODEL, "messages": _user(), "stream": True}
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", gateway.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        frames = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = httpx.Response(200, content=frames[-2]).json()["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "api_error"
    assert ups.omni_b.request_count == 0  # no failover after the first byte


def test_sdk_raises_on_mid_stream_error(client, ups):
    ups.omni_a.enqueue(Script(flavour="omni", fault="malformed_json", fault_after_chunks=2))
    stream = client.chat.completions.create(model=OMNI_MODEL, messages=_user(), stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_unknown_fields_are_not_forwarded(client, ups):
    # A field the gateway does not forward is refused by name (tests/contract/test_chat_surface.py has
    # the `drop` setting); nothing reaches the engine.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=TEXT_MODEL,
            messages=_user(),
            extra_body={
                "api_base": "http://169.254.169.254",
                "base_url": "http://evil",
                "headers": {"x": "y"},
            },
        )
    assert err.value.body["param"] == "api_base" and err.value.body["code"] == "unknown_field"
    assert ups.vllm.request_count == 0
    client.chat.completions.create(
        model=TEXT_MODEL,
        messages=_user(),
        extra_body={"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}},
        temperature=0.2,
    )
    sent = ups.vllm.requests[-1]
    for forbidden in ("api_base", "base_url", "headers"):
        assert forbidden not in sent
    assert sent["top_k"] == 5 and sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["temperature"] == 0.2
    assert sent["model"] == "scripted"  # the engine's own id, not the public name


def test_speech_from_text_only_engine_is_degraded_not_refused(gateway, ups):
    body = {
        "model": TEXT_MODEL,
        "messages": _user(),
        "modalities": ["text", "audio"],
        "audio": {"voice": "Ethan", "format": "wav"},
    }
    resp = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200
    assert resp.headers["x-omnigate-degraded"] == "engine-text-only"
    assert resp.json()["choices"][0]["message"]["content"] == Script().text
    assert "audio" not in ups.vllm.requests[-1].get("modalities", [])


def test_litellm_engine_streams(client, ups):
    ups.vllm.default = Script(flavour="vllm", text="Through litellm we go.")
    stream = client.chat.completions.create(model=LITELLM_MODEL, messages=_user(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Through litellm we go."


def test_models_health_ready_metrics(gateway, ups, client):
    ids = {m.id for m in client.models.list()}
    assert ids == {OMNI_MODEL, TEXT_MODEL, LITELLM_MODEL}
    assert httpx.get(gateway.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/readyz")
    # Status only without the admin credential (detail: tests/http/test_front_door.py).
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    client.chat.completions.create(model=TEXT_MODEL, messages=_user())
    text = httpx.get(gateway.url + "/metrics").text
    for name in (
        "omnigate_requests_total",
        "omnigate_time_to_first_token_seconds",
        "omnigate_requests_in_flight",
        "omnigate_policy_decisions_total",
        "omnigate_request_duration_seconds",
    ):
        assert name in text


def test_client_disconnect_aborts_upstream_when_not_streaming(gateway, ups):
    ups.omni_a.default = Script(flavour="omni", chunk_delay_s=0.3)  # the answer takes seconds
    body = {"model": OMNI_MODEL, "messages": _user()}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=0.5)
    assert wait_until(lambda: ups.omni_a.aborts == 1, timeout=3)
    assert ups.omni_a.completed == 0


def test_a_spoken_conversation_appending_each_answer_as_the_sdk_returns_it(client, ups):
    """``messages.append(resp.choices[0].message)``, as every tutorial writes it, with speech on."""
    ups.omni_a.default = Script(flavour="omni", text="Paris it is.", audio_chunks=2)
    messages: list = [{"role": "system", "content": "You are a voice assistant."}]
    ids = []
    for turn in ("Capital of France?", "Say it again.", "Thanks."):
        messages.append({"role": "user", "content": turn})
        resp = client.chat.completions.create(
            model=OMNI_MODEL,
            messages=messages,
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "wav"},
        )
        message = resp.choices[0].message
        assert message.audio is not None and message.audio.transcript == "Paris it is."
        ids.append(message.audio.id)
        messages.append(message)  # the SDK's own object, audio and all
    assert len(set(ids)) == 3
    sent = ups.omni_a.requests[-1]["messages"]
    assert [m for m in sent if m["role"] == "assistant"] == [
        {"role": "assistant", "content": "Paris it is."}
    ] * 2


def test_the_reference_shape_and_an_unknown_audio_id(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Paris it is.", audio_chunks=2)
    speech = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
    first = [{"role": "user", "content": "Capital of France?"}]
    answer = client.chat.completions.create(model=OMNI_MODEL, messages=first, **speech)
    turns = [*first, {"role": "assistant", "audio": {"id": answer.choices[0].message.audio.id}}]
    again = client.chat.completions.create(model=OMNI_MODEL, messages=[*turns, *_user("More.")], **speech)
    assert again.choices[0].message.audio.transcript == "Paris it is."
    unknown = [*first, {"role": "assistant", "audio": {"id": "audio_not-one-of-ours"}}, *_user("More.")]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=OMNI_MODEL, messages=unknown, **speech)
    assert caught.value.body["code"] == "audio_not_found"
    assert caught.value.body["param"] == "messages.1.audio.id"


def test_vllm_extras_through_extra_body(client, ups):
    ups.vllm.default = Script(text="Yes.")
    client.chat.completions.create(
        model=TEXT_MODEL,
        messages=_user(),
        extra_body={
            "min_p": 0.1,
            "min_tokens": 1,
            "ignore_eos": False,
            "stop_token_ids": [2],
            "guided_choice": ["Yes."],
        },
    )
    sent = ups.vllm.requests[-1]
    assert (sent["min_p"], sent["min_tokens"], sent["ignore_eos"], sent["stop_token_ids"]) == (
        0.1,
        1,
        False,
        [2],
    )
    assert sent["structured_outputs"] == {"choice": ["Yes."]}
