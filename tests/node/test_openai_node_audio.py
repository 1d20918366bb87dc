"""The audio endpoints with the official openai-node SDK: ``client.audio.transcriptions.create`` (the file
handed over with ``toFile``) and ``client.audio.speech.create`` against a real uvicorn gateway and the
scripted vLLM-Omni over real sockets (node scripts driven from here, tests/node/sdk.py)."""

from __future__ import annotations

import base64
import io

import pytest
import soundfile as sf

from tests.conftest import OMNI_MODEL
from tests.media import tone, wav
from tests.node import sdk
from tests.upstream import Script

pytestmark = pytest.mark.timeout(600)  # node and npm come from scripts/test-env.sh

SAID = "Node hears the scripted engine."


@pytest.fixture
def url(gateway) -> str:
    return gateway.url + "/v1"


def _file(audio: bytes, name: str = "clip.wav", **fields) -> dict:
    return {"file_b64": base64.b64encode(audio).decode(), "filename": name, "model": OMNI_MODEL, **fields}


def test_a_transcription(url, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    got = sdk.call(url, "transcribe", _file(wav(tone(2.0), 16000), language="en"))
    assert got["transcription"]["text"] == SAID
    assert got["transcription"]["usage"] == {"type": "duration", "seconds": pytest.approx(2.0, abs=0.01)}
    assert ups.omni_a.requests[-1]["messages"][0]["content"][0]["type"] == "input_audio"


def test_a_text_transcription(url, ups):
    ups.omni_a.default = Script(flavour="omni", text=SAID)
    got = sdk.call(url, "transcribe", _file(wav(tone(1.0), 16000), response_format="text"))
    assert got["transcription"] == SAID


def test_a_file_that_is_not_audio_is_the_sdks_bad_request(url, ups):
    got = sdk.call(url, "transcribe", _file(b"just some text, not audio" * 40, name="a.txt"))
    assert got["error"]["status"] == 400 and got["error"]["body"]["code"] == "invalid_media"
    assert ups.omni_a.request_count == 0


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_speech(url, ups, fmt):
    ups.omni_a.default = Script(flavour="omni", text=SAID, audio_chunks=5, sample_rate=24000)
    got = sdk.call(
        url, "speech", {"model": OMNI_MODEL, "input": SAID, "voice": "Ethan", "response_format": fmt}
    )
    assert got["content_type"] == f"audio/{fmt}"
    samples, rate = sf.read(io.BytesIO(base64.b64decode(got["audio_b64"])), dtype="int16")
    assert rate == 24000 and len(samples) == 5 * int(24000 * 0.2)
    assert ups.omni_a.requests[-1]["modalities"] == ["audio"]


def test_speech_over_the_input_limit_is_the_sdks_bad_request(url, ups):
    got = sdk.call(url, "speech", {"model": OMNI_MODEL, "input": "x" * 5000, "voice": "Ethan"})
    assert got["error"]["status"] == 400 and got["error"]["body"]["param"] == "input"
