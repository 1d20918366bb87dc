"""The audio endpoints through the official openai SDK: ``audio.transcriptions.create`` and
``audio.speech.create`` (whole and with ``with_streaming_response``) against a real gateway and the
scripted vLLM-Omni over real sockets. Each is served as the chat completion it stands for: the engine
sees one ``input_audio`` part and a transcription instruction, or the text to read with
``modalities: ["audio"]``; each call leaves an audit record with what the endpoint served."""

from __future__ import annotations

import base64
import io
import sqlite3

import numpy as np
import openai
import orjson
import pytest
import soundfile as sf

from tests.conftest import OMNI_MODEL
from tests.media import tone, wav
from tests.upstream import Script

pytestmark = pytest.mark.timeout(60)

SAID = "The quick brown fox jumps over the lazy dog."


def _records(gateway) -> list[dict]:
    path = gateway.services.settings.audit.sqlite_path
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT data FROM audit_log WHERE kind = 'request' ORDER BY seq").fetchall()
    finally:
        db.close()
    return [orjson.loads(r[0])["payload"] for r in rows]


def _record_of(gateway, request_id: str) -> dict:
    db = sqlite3.connect(gateway.services.settings.audit.sqlite_path)
    try:
        rows = db.execute(
            "SELECT data FROM audit_log WHERE kind = 'request' AND request_id = ?", (request_id,)
        ).fetchall()
    finally:
        db.close()
    assert len(rows) == 1, rows
    return orjson.loads(rows[0][0])["payload"]


# -- transcriptions --------------------------------------------------------------------------------------


def test_a_transcription_is_the_engines_text_for_one_input_audio_part(client, ups, gateway):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    audio = wav(tone(2.0, 16000), 16000)
    raw = client.audio.transcriptions.with_raw_response.create(
        file=("clip.wav", audio, "audio/wav"), model=OMNI_MODEL, language="en", prompt="Fox, dog."
    )
    result = raw.parse()
    assert result.text == SAID
    assert result.usage is not None and result.usage.type == "duration"
    assert result.usage.seconds == pytest.approx(2.0, abs=0.01)
    # What the engine was asked: one user message, the audio and the instruction, text out.
    (sent,) = ups.omni_a.requests[-1:]
    assert sent["modalities"] == ["text"]
    (message,) = sent["messages"]
    kinds = [p["type"] for p in message["content"]]
    assert kinds == ["input_audio", "text", "text"]
    assert base64.b64decode(message["content"][0]["input_audio"]["data"]) == audio
    assert "verbatim" in message["content"][1]["text"] and "code en" in message["content"][1]["text"]
    assert "Fox, dog." in message["content"][2]["text"]
    # One audit record: the endpoint, the input's length and digests, the transcript's digest.
    record = _record_of(gateway, raw.headers["x-request-id"])
    facts = record["notes"]["audio"]
    assert facts["endpoint"] == "transcriptions" and facts["input_seconds"] == pytest.approx(2.0, abs=0.01)
    assert facts["input_bytes"] == len(audio) and facts["output_chars"] == len(SAID)
    assert record["outcome"] == "served" and record["input"]


@pytest.mark.parametrize("fmt", ["text", "verbose_json"])
def test_text_and_verbose_json_transcripts(client, ups, fmt):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    audio = wav(tone(1.5, 16000), 16000)
    result = client.audio.transcriptions.create(
        file=("clip.wav", audio), model=OMNI_MODEL, response_format=fmt, language="en"
    )
    if fmt == "text":
        assert result == SAID
    else:
        assert result.text == SAID and result.duration == pytest.approx(1.5, abs=0.01)
        assert result.language == "en"


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitle_formats_are_a_clear_400(client, ups, fmt):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(
            file=("clip.wav", wav(tone(1.0), 16000)), model=OMNI_MODEL, response_format=fmt
        )
    assert err.value.body["param"] == "response_format" and "timestamps" in err.value.body["message"]


def test_a_file_that_is_not_audio_is_a_400(client, ups):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(file=("notes.txt", b"hello, this is text " * 50), model=OMNI_MODEL)
    assert err.value.body["code"] == "invalid_media", err.value.body
    assert ups.omni_a.request_count == 0 and ups.omni_b.request_count == 0


def test_an_unknown_model_is_a_404(client, ups):
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.transcriptions.create(file=("a.wav", wav(tone(1.0), 16000)), model="no-such-model")
    assert err.value.body["code"] == "model_not_found"


# -- speech -------------------------------------------------------------------------------------------


def _pcm(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    got, rate = sf.read(io.BytesIO(data), dtype="int16")
    return got, rate


def test_speech_is_the_engines_audio_as_a_wav_file(client, ups, gateway):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=5, sample_rate=24000)
    raw = client.audio.speech.with_raw_response.create(
        model=OMNI_MODEL, input=SAID, voice="Ethan", response_format="wav"
    )
    data = raw.content
    assert raw.headers["content-type"] == "audio/wav"
    samples, rate = _pcm(data, "wav")
    assert rate == 24000 and len(samples) == 5 * int(24000 * 0.2)
    sent = ups.omni_a.requests[-1]
    assert sent["modalities"] == ["audio"] and sent["messages"][-1] == {"role": "user", "content": SAID}
    assert sent["max_tokens"] <= len(SAID) + 32
    record = _record_of(gateway, raw.headers["x-request-id"])
    facts = record["notes"]["audio"]
    assert facts["endpoint"] == "speech" and facts["output_seconds"] == pytest.approx(1.0, abs=0.01)
    assert facts["output_bytes"] == len(data) and record["usage"]["audio_seconds"] == pytest.approx(1.0)
    assert record["output"]


@pytest.mark.parametrize("rate", [24000, 44100])  # talkers speak at 16, 24, 44.1 or 48 kHz (WIRE.md)
@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "aac"])
def test_speech_in_every_openai_format(client, ups, fmt, rate):
    ups.omni_a.default = Script(flavour="omni", text="Hello.", audio_chunks=5, sample_rate=rate)
    data = client.audio.speech.create(
        model=OMNI_MODEL, input="Hello.", voice="Ethan", response_format=fmt
    ).read()
    import av

    with av.open(io.BytesIO(data)) as container:
        seconds = sum(f.samples / f.sample_rate for f in container.decode(audio=0))
    assert seconds == pytest.approx(1.0, rel=0.1)  # five pieces of 0.2 s


def test_pcm_is_raw_24khz_samples_whatever_the_engines_rate(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Hello.", audio_chunks=5, sample_rate=16000)
    data = client.audio.speech.create(
        model=OMNI_MODEL, input="Hello.", voice="Ethan", response_format="pcm"
    ).read()
    assert len(data) // 2 == pytest.approx(24000, rel=0.02)


def test_speed_reads_faster(client, ups):
    ups.omni_a.default = Script(flavour="omni", text="Hello.", audio_chunks=10, sample_rate=24000)
    data = client.audio.speech.create(
        model=OMNI_MODEL, input="Hello.", voice="Ethan", response_format="wav", speed=2.0
    ).read()
    samples, _ = _pcm(data, "wav")
    assert len(samples) == pytest.approx(24000, rel=0.05)


def test_speech_streams_through_with_streaming_response(client, ups, tmp_path):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=4, sample_rate=24000)
    out = tmp_path / "speech.wav"
    with client.audio.speech.with_streaming_response.create(
        model=OMNI_MODEL, input=SAID, voice="Ethan", response_format="wav"
    ) as response:
        response.stream_to_file(out)
    samples, rate = sf.read(out, dtype="int16")
    assert rate == 24000 and len(samples) == 4 * int(24000 * 0.2)


def test_an_answer_without_audio_is_a_502(client, ups, gateway):
    # An engine that ignores modalities and answers in text only.
    ups.omni_a.default = Script(flavour="vllm", text="I would rather write.")
    ups.omni_b.default = Script(flavour="vllm", text="I would rather write.")
    with pytest.raises(openai.InternalServerError) as err:
        client.audio.speech.create(model=OMNI_MODEL, input="Read me.", voice="Ethan", response_format="wav")
    assert err.value.status_code == 502 and err.value.body["type"] == "api_error"
    assert "without audio" in err.value.body["message"]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"input": "x" * 4097}, "input"),
        ({"response_format": "ogg"}, "response_format"),
        ({"speed": 5.0}, "speed"),
        ({"stream_format": "sse"}, "stream_format"),
    ],
)
def test_bad_speech_requests_are_400s_naming_the_field(client, ups, kw, param):
    body = {"model": OMNI_MODEL, "input": "Hello.", "voice": "Ethan", **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.speech.create(**body)
    assert err.value.body["param"] == param, err.value.body
    assert ups.omni_a.request_count == 0


def test_the_docs_python_examples_run_as_written(gateway, ups, tmp_path):
    """docs/audio.md's Python examples, run as a user runs them: the SDK configured from the environment."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "audio.md").read_text()
    transcribe, speak = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    (tmp_path / "question.wav").write_bytes(wav(tone(1.0), 16000))
    env = {**os.environ, "OPENAI_BASE_URL": gateway.url + "/v1", "OPENAI_API_KEY": "unused"}
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=3)
    out = {}
    for name, code in (("transcribe.py", transcribe), ("speak.py", speak)):
        (tmp_path / name).write_text(code)
        done = subprocess.run(
            [sys.executable, name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = done.stdout
    assert out == {"transcribe.py": SAID + "\n", "speak.py": ""}
    samples, rate = sf.read(tmp_path / "answer.wav", dtype="int16")
    assert rate == 24000 and len(samples) == 3 * int(24000 * 0.2)


def test_the_openapi_document_declares_both_operations(gateway):
    import httpx

    doc = httpx.get(gateway.url + "/openapi.json").json()
    speech = doc["paths"]["/v1/audio/speech"]["post"]
    form = doc["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert speech["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SpeechRequest")
    schemas = doc["components"]["schemas"]
    assert form["schema"]["$ref"].endswith("/TranscriptionForm")
    assert schemas["TranscriptionForm"]["required"][:2] == ["file", "model"]
    assert schemas["SpeechRequest"]["properties"]["input"]["maxLength"] == 4096
    formats = schemas["TranscriptionForm"]["properties"]["response_format"]["enum"]
    assert formats == ["json", "text", "verbose_json", "srt", "vtt"]
    ok = doc["paths"]["/v1/audio/transcriptions"]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"application/json", "text/plain"}
    assert all(f"`{f}`" in ok["description"] for f in formats)
