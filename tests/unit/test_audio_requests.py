"""What the audio endpoints are served as (gateway/pipeline/audio.py) and what the route reads of an upload
(gateway/api/audio.py): the chat request each stands for, the refusal of speech without audio, and the
format an upload declares."""

from __future__ import annotations

import pytest

from core.context import DEGRADED_TEXT_ONLY, RequestContext
from core.errors import EngineProtocolError, Overloaded
from core.events import Completion
from core.schemas import SpeechRequest, TranscriptionRequest
from gateway.api.audio_fields import format_of
from gateway.api.audio_form import Upload
from gateway.pipeline.audio import speech_chat, spoken, transcription_chat
from gateway.pipeline.complete import CompletionResult


def test_a_transcription_is_one_user_turn_with_the_audio_first_then_the_instruction():
    form = TranscriptionRequest(model="m", language="de", prompt="Zürich", temperature=0.1)
    chat = transcription_chat(form, "UklGRg==", "wav")
    (message,) = chat.messages
    audio, instruction, hint = message.content
    assert audio.input_audio.data == "UklGRg==" and audio.input_audio.format == "wav"
    assert "verbatim" in instruction.text and "de" in instruction.text and "Zürich" in hint.text
    assert chat.modalities == ["text"] and chat.temperature == 0.1 and not chat.stream


def test_speech_is_a_reading_with_audio_out_and_a_bounded_output():
    speech = SpeechRequest(model="m", input="Read me.", voice="Ethan", instructions="Slowly.")
    chat = speech_chat(speech)
    system, user = chat.messages
    assert user.content == "Read me." and "Slowly." in system.text() and "word for word" in system.text()
    assert chat.modalities == ["audio"] and chat.audio is not None
    assert (chat.audio.voice, chat.audio.format) == ("Ethan", "wav")
    assert chat.max_tokens == len("Read me.") + 32


def _result(completion: Completion) -> CompletionResult:
    speech = speech_chat(SpeechRequest(model="m", input="x", voice="v"))
    return CompletionResult(speech, completion, RequestContext.new("r"))


def test_speech_with_audio_is_served():
    spoken(_result(Completion(audio=b"\0\0" * 10, sample_rate=24000)), RequestContext.new("r"))


def test_an_answer_without_audio_is_the_engines_fault():
    with pytest.raises(EngineProtocolError) as err:
        spoken(_result(Completion(text="I would rather write.")), RequestContext.new("r"))
    assert err.value.status == 502 and "without audio" in err.value.message


def test_speech_shed_to_text_under_load_is_a_503_to_retry():
    ctx = RequestContext.new("r")
    ctx.outputs.degrade(DEGRADED_TEXT_ONLY)
    with pytest.raises(Overloaded) as err:
        spoken(_result(Completion(text="x")), ctx)
    assert err.value.status == 503 and err.value.headers() == {"Retry-After": "1"}


def _upload(filename: str = "", content_type: str = "", head: bytes = b"") -> Upload:
    return Upload({}, head, filename, content_type, len(head), "", head)


@pytest.mark.parametrize(
    "upload, fmt",
    [
        (_upload("talk.WAV"), "wav"),
        (_upload("talk.mpga"), "mp3"),
        (_upload("voice.m4a"), "m4a"),
        (_upload("upload", "audio/flac"), "flac"),
        (_upload("upload", "application/octet-stream", b"OggS\0\2"), "ogg"),
        (_upload("", "", b"ID3\4\0"), "mp3"),
        (_upload("", "", b"\xff\xfb\x90\x00"), "mp3"),
        (_upload("", "", b"\0\0\0\x20ftypM4A "), "m4a"),
        (_upload("", "", b"%PDF-1.7"), "bin"),
    ],
)
def test_the_format_an_upload_declares(upload, fmt):
    assert format_of(upload) == fmt


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 32000, 44100, 48000])
@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_speech_is_encoded_in_every_format_at_every_talker_rate(rate, fmt):
    """Talkers speak at 16, 24, 44.1 or 48 kHz (and others): every format is served from each (Opus itself
    takes only 8, 12, 16, 24 and 48 kHz: the gateway resamples to it)."""
    import io

    import av
    import numpy as np

    from gateway.api.audio_render import PCM_RATE, encode_speech

    pcm = (np.sin(np.arange(rate) * 2 * np.pi * 440 / rate) * 8000).astype("<i2").tobytes()  # one second
    data = encode_speech(pcm, rate, 1, fmt)
    if fmt == "pcm":
        assert len(data) == 2 * PCM_RATE
        return
    with av.open(io.BytesIO(data)) as container:
        seconds = sum(f.samples / f.sample_rate for f in container.decode(audio=0))
    # AAC adds its encoder's priming and padding: up to two frames of 1,024 samples.
    assert seconds == pytest.approx(1.0, abs=2048 / rate + 0.01 if fmt == "aac" else 0.1)
