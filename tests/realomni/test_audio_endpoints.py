"""The audio endpoints against the real vLLM-Omni (its tiny random-weight Qwen3-Omni on the CPU) through the
gateway, with the official openai SDK: a transcription is one chat completion with the uploaded audio as an
``input_audio`` part, text out; speech is one with ``modalities: ["audio"]``, its WAV re-encoded as asked.
The model's weights are random, so its words are not checked; the shapes, the audio and the records are."""

from __future__ import annotations

import io
import sqlite3

import orjson
import pytest
import soundfile as sf

from tests.media import tone, wav
from tests.realomni.conftest import MODEL

pytestmark = [pytest.mark.realomni, pytest.mark.timeout(900)]


def _record(gateway, request_id: str) -> dict:
    db = sqlite3.connect(gateway.db)
    try:
        rows = db.execute(
            "SELECT data FROM audit_log WHERE kind = 'request' AND request_id = ?", (request_id,)
        ).fetchall()
    finally:
        db.close()
    assert len(rows) == 1
    return orjson.loads(rows[0][0])["payload"]


@pytest.mark.parametrize("fmt, rate", [("wav", 24000), ("flac", 24000)])
def test_speech_is_the_engines_own_voice_in_the_format_asked(via, omni_gateway, fmt, rate):
    raw = via.audio.speech.with_raw_response.create(
        model=MODEL, input="Hello there.", voice="Ethan", response_format=fmt
    )
    samples, got_rate = sf.read(io.BytesIO(raw.content), dtype="int16")
    assert got_rate == rate and len(samples) > 0
    facts = _record(omni_gateway, raw.headers["x-request-id"])["notes"]["audio"]
    assert facts["endpoint"] == "speech" and facts["output_seconds"] == pytest.approx(
        len(samples) / rate, abs=0.02
    )


def test_a_transcription_is_the_engines_text_for_the_uploaded_audio(via, omni_gateway):
    audio = wav(tone(1.5, 16000), 16000)
    raw = via.audio.transcriptions.with_raw_response.create(model=MODEL, file=("q.wav", audio), language="en")
    result = raw.parse()
    assert isinstance(result.text, str)
    assert result.usage.seconds == pytest.approx(1.5, abs=0.01)
    record = _record(omni_gateway, raw.headers["x-request-id"])
    # The audio reached the thinker: its tokens are most of the prompt.
    assert record["outcome"] == "served" and record["usage"]["prompt_tokens"] > 20
