"""The audio endpoints' answers: speech encoded as the client asked, a transcript in its response format.

Speech comes from the engine as PCM16 (core/events.py) and leaves as OpenAI's ``/v1/audio/speech``
formats: ``wav``, ``flac``, ``mp3`` and ``opus`` as chat's spoken answers are encoded (core/audio.py,
libsndfile), ``aac`` (ADTS) through PyAV, ``pcm`` as OpenAI defines it: raw 16-bit little-endian
samples at 24 kHz, mono (resampled when the engine speaks at another rate). ``speed`` other than 1 is
FFmpeg's ``atempo`` filter (the pitch kept). All of it is CPU work on a whole answer: the route runs it
on a thread. numpy and the codecs load with the first answer that needs them: a text gateway never does.
"""

from __future__ import annotations

import fractions
import io
from typing import Any

from core import audio as audio_codec
from engines.adapters.stt import Transcript

#: the ``Content-Type`` of each speech format
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
#: OpenAI's raw ``pcm``: 24 kHz, 16-bit, mono
PCM_RATE = 24000
#: the factor one ``atempo`` filter takes at most (and 1 / it at least), in every FFmpeg build
_TEMPO_STEP = 2.0


def encode_speech(pcm: bytes, rate: int, channels: int, fmt: str, speed: float = 1.0) -> bytes:
    """The spoken answer ``pcm`` (16-bit at ``rate``) as a ``fmt`` file, read at ``speed``."""
    if channels != 1:  # the speech formats are mono: the channels mixed down
        import numpy as np  # numpy and the codecs load with the first answer that needs them

        frames = np.frombuffer(pcm, dtype="<i2").reshape(-1, channels).astype(np.int32)
        pcm, channels = frames.mean(axis=1).astype("<i2").tobytes(), 1
    if speed != 1.0:
        pcm = _filtered(pcm, rate, _tempo_chain(speed))
    if fmt == "pcm":
        if rate != PCM_RATE:
            pcm = _filtered(pcm, rate, [("aresample", str(PCM_RATE))], out_rate=PCM_RATE)
        return pcm
    if fmt == "aac":
        return _aac(pcm, rate)
    return audio_codec.encode(pcm, rate, 1, fmt)  # opus at a rate it does not code: resampled to 48 kHz


def _tempo_chain(speed: float) -> list[tuple[str, str]]:
    """``atempo`` steps whose product is ``speed``, each within what every FFmpeg build accepts."""
    steps: list[tuple[str, str]] = []
    left = speed
    while left > _TEMPO_STEP:
        steps.append(("atempo", f"{_TEMPO_STEP}"))
        left /= _TEMPO_STEP
    while left < 1 / _TEMPO_STEP:
        steps.append(("atempo", f"{1 / _TEMPO_STEP}"))
        left *= _TEMPO_STEP
    steps.append(("atempo", f"{left:.6f}"))
    return steps


def _frame(pcm: bytes, rate: int) -> Any:
    import av  # the codecs load with the first speech answer that needs them
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = rate
    frame.pts = 0
    frame.time_base = fractions.Fraction(1, rate)
    return frame


def _filtered(pcm: bytes, rate: int, filters: list[tuple[str, str]], out_rate: int | None = None) -> bytes:
    """``pcm`` through an FFmpeg filter chain, back as 16-bit mono PCM (at ``out_rate``, or ``rate``)."""
    import av

    graph = av.filter.Graph()
    nodes = [
        graph.add_abuffer(
            format="s16", sample_rate=rate, layout="mono", time_base=fractions.Fraction(1, rate)
        )
    ]
    nodes += [graph.add(name, args) for name, args in filters]
    fmt = "sample_fmts=s16:channel_layouts=mono" + (f":sample_rates={out_rate}" if out_rate else "")
    nodes += [graph.add("aformat", fmt), graph.add("abuffersink")]
    graph.link_nodes(*nodes).configure()
    graph.push(_frame(pcm, rate))
    graph.push(None)
    out = bytearray()
    while True:
        try:
            frame = graph.pull()
        except (av.error.BlockingIOError, av.error.EOFError):
            break
        out += frame.to_ndarray().tobytes()
    return bytes(out)


def _aac(pcm: bytes, rate: int) -> bytes:
    """AAC in ADTS frames (what OpenAI's ``aac`` is): libsndfile has no AAC encoder, FFmpeg has."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="adts") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        for packet in stream.encode(_frame(pcm, rate)):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def transcript_body(
    heard: Transcript, response_format: str, seconds: float | None, language: str | None
) -> tuple[bytes, str]:
    """A transcript as ``response_format`` asks: the bytes and their ``Content-Type``. ``seconds`` is the
    audio's length as the media steps measured it; the engine's own, where it said, goes in ``duration``.
    Segments and words are there when a speech-to-text engine gave them; ``srt`` and ``vtt`` are made of
    the segments (only such an engine's transcripts are served in them)."""
    import orjson

    text = heard.text.strip()
    if response_format == "text":
        return text.encode("utf-8"), "text/plain; charset=utf-8"
    if response_format in ("srt", "vtt"):
        return subtitles(heard.segments, response_format).encode("utf-8"), "text/plain; charset=utf-8"
    usage = {"type": "duration", "seconds": seconds or heard.duration or 0.0}
    if response_format == "verbose_json":
        duration = heard.duration if heard.duration is not None else seconds
        body: dict[str, Any] = {
            "task": "transcribe",
            "language": heard.language or language or "",
            "duration": duration or 0.0,
            "text": text,
            "usage": usage,
        }
        if heard.segments:
            body["segments"] = heard.segments
        if heard.words:
            body["words"] = heard.words
        return orjson.dumps(body), "application/json"
    return orjson.dumps({"text": text, "usage": usage}), "application/json"


def subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    """Segments as SubRip (``srt``) or WebVTT (``vtt``) cues."""
    sep = "," if fmt == "srt" else "."

    def stamp(t: float) -> str:
        ms = max(0, round(t * 1000))
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"

    cues = [f"{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text'].strip()}\n" for s in segments]
    if fmt == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)
