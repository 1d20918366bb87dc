"""A scripted stand-in for a vLLM or vLLM-Omni server, speaking their wire shapes over real sockets.

Tests and benchmarks point an engine adapter at it, script replies and faults, and read back what it saw.

Its length: one server for both flavours, every scripted fault, and vLLM-Omni's metrics and sleep routes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import itertools
import math
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import orjson
import soundfile as sf
from aiohttp import web

from tests.realtime_engine import RealtimeEngine

Flavour = Literal["vllm", "omni"]
Fault = Literal[
    None,
    "500_before_headers",
    "503_retry_after",
    "reset_before_first_byte",
    "reset_mid_stream",
    "hang_before_first_byte",
    "hang_mid_stream",
    "malformed_json",
    "error_mid_stream",
    "drip",
    "400_before_headers",
]
_FLAVOURS = frozenset(get_args(Flavour))
_FAULTS = frozenset(get_args(Fault))

_SECONDS_PER_CHAR = 0.06
_DRIP_INTERVAL_S = 1.0


@dataclass
class Script:
    """How to answer one chat request.

    `fault_after_chunks` counts `data:` frames, the opening role frame included. `status_body` replaces the
    JSON body of the scripted 500 and 503 replies. `audio_wav` names a mono 16-bit WAV file whose speech is sent
    as the answer's audio (at the file's sample rate) instead of the synthetic voice.
    """

    flavour: Flavour = "vllm"
    text: str = "Hello from the scripted upstream. It speaks in short sentences."
    chunk_words: int = 1
    transcript: str | None = None
    audio_seconds_per_chunk: float = 0.2
    audio_chunks: int | None = None
    sample_rate: int = 24000
    first_byte_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    fault: Fault = None
    fault_after_chunks: int = 3
    prompt_tokens: int = 11
    status_body: dict | None = None
    audio_wav: str | None = None
    # An engine that ignores max_tokens (the gateway must cut the stream itself).
    ignore_max_tokens: bool = False
    # Speech interleaved with text, as an engine whose talker runs alongside its thinker sends it:
    # one audio frame after every N text frames (0: all text first, then all audio).
    audio_interleave: int = 0
    # A pause between the [DONE] frame and the end of the chunked body (its terminator), as a server
    # that writes them separately shows it to a client reading fast.
    eof_delay_s: float = 0.0
    # vLLM-Omni builds differ (see WIRE.md). "every": each streamed audio piece is a complete WAV file (0.30.0);
    # "first": only the first piece has a RIFF header, the rest are bare PCM.
    omni_wav_headers: Literal["every", "first"] = "every"
    # False: the build sends no audio_metadata on audio choices.
    omni_audio_metadata: bool = True
    # Not streamed, text + audio: "merged" is 0.30.0's one choice; "split" the older two choices, both index 0,
    # text first; "split_audio_first" the same with the audio stage finishing first.
    omni_choices: Literal["merged", "split", "split_audio_first"] = "merged"
    # A source version's bare {"delta": {}, "finish_reason": "stop"} closing chunk without a modality.
    omni_bare_finish: bool = False
    # vLLM flavour: tool calls to answer with ({"name", "arguments"} each; arguments streamed in pieces
    # of `tool_chunk_chars`, finish_reason "tool_calls"), reasoning text sent before the answer under
    # `reasoning_key` (vLLM has used "reasoning_content" and "reasoning"), and logprobs on every text
    # piece whenever the request asks for them, as vLLM sends them.
    # An engine without structured output: its text is sent as scripted whatever the request's
    # response_format (by default the scripted engine keeps to a json_schema, as vLLM does).
    ignore_response_format: bool = False
    tool_calls: list[dict] | None = None
    tool_chunk_chars: int = 8
    reasoning: str | None = None
    reasoning_key: str = "reasoning_content"

    def __post_init__(self) -> None:
        if self.flavour not in _FLAVOURS:
            raise ValueError(f"flavour must be one of {sorted(_FLAVOURS)}, not {self.flavour!r}")
        if self.fault not in _FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}")
        if self.chunk_words < 1:
            raise ValueError("chunk_words must be >= 1")
        if self.audio_seconds_per_chunk <= 0 or self.sample_rate <= 0:
            raise ValueError("audio_seconds_per_chunk and sample_rate must be positive")
        if self.omni_wav_headers not in ("every", "first"):
            raise ValueError("omni_wav_headers must be 'every' or 'first'")
        if self.omni_choices not in ("merged", "split", "split_audio_first"):
            raise ValueError("omni_choices must be 'merged', 'split' or 'split_audio_first'")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Script:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Script fields: {sorted(unknown)}")
        return cls(**data)

    @property
    def spoken(self) -> str:
        return self.text if self.transcript is None else self.transcript

    @property
    def n_audio_chunks(self) -> int:
        if self.audio_wav is not None:
            pcm, rate = _wav_file(self.audio_wav)
            return max(1, math.ceil(len(pcm) / (rate * self.audio_seconds_per_chunk) - 1e-9))
        if self.audio_chunks is not None:
            return max(0, self.audio_chunks)
        total_s = _SECONDS_PER_CHAR * len(self.spoken)
        return max(1, math.ceil(total_s / self.audio_seconds_per_chunk - 1e-9))


# --- precomputed wire pieces (cached: the benchmarks run many identical streams) ---------------------------


@functools.lru_cache(maxsize=64)
def _text_pieces(text: str, chunk_words: int) -> tuple[str, ...]:
    # Each word keeps its trailing whitespace (leading whitespace rides on the first), so "".join == text.
    words: list[str] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j].isspace() and not words:
            j += 1
        while j < n and not text[j].isspace():
            j += 1
        while j < n and text[j].isspace():
            j += 1
        words.append(text[i:j])
        i = j
    return tuple("".join(words[k : k + chunk_words]) for k in range(0, len(words), chunk_words))


@functools.lru_cache(maxsize=64)
def _text_deltas(text: str, chunk_words: int) -> tuple[bytes, ...]:
    return tuple(b'{"content":' + orjson.dumps(p) + b"}" for p in _text_pieces(text, chunk_words))


def _wav(pcm: np.ndarray, sample_rate: int) -> bytes:
    data = pcm.astype("<i2").tobytes()
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", 36 + len(data), b"WAVE", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16,
        b"data", len(data),
    )  # fmt: skip
    return header + data


@functools.lru_cache(maxsize=32)
def _pcm_chunks(sample_rate: int, seconds: float, count: int) -> tuple[np.ndarray, ...]:
    """A voiced-sounding signal: harmonics of a gliding f0 under a syllable envelope, different per chunk."""
    n = max(1, round(seconds * sample_rate))
    t = np.arange(n) / sample_rate
    out = []
    for i in range(count):
        f0 = 110.0 + 40.0 * math.sin(0.9 * i) + 15.0 * np.sin(2 * np.pi * 3.0 * t)
        phase = 2 * np.pi * np.cumsum(f0) / sample_rate
        sig = sum((0.7**k) * np.sin(k * phase + 0.3 * i * k) for k in range(1, 7))
        env = np.sin(np.pi * (t + 0.5 * (i % 2) * seconds) / seconds * 2.0) ** 2 * 0.8 + 0.2
        env *= np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.005 + 1e-3)  # no clicks at the seams
        sig = sig * env
        sig = sig / (np.max(np.abs(sig)) or 1.0) * 0.6
        out.append(np.round(sig * 32767).astype(np.int16))
    return tuple(out)


def _encode_pieces(
    pieces: tuple[np.ndarray, ...], rate: int, mode: str, metadata: bool
) -> tuple[tuple[bytes, bytes], ...]:
    """Per audio piece: its delta and its ``audio_metadata`` member (empty without metadata).

    ``mode``: "every" (each piece a complete WAV file, vLLM-Omni 0.30.0), "first" (a header on the first
    piece only) or "pcm" (bare PCM16, what vLLM-Omni sends when asked for ``pcm``).
    """
    out = []
    for i, pcm in enumerate(pieces):
        wav = mode == "every" or (mode == "first" and i == 0)
        data = _wav(pcm, rate) if wav else pcm.astype("<i2").tobytes()
        b64 = base64.b64encode(data)
        meta = b""
        if metadata:
            fmt = "pcm" if mode == "pcm" else "wav"
            meta = b',"audio_metadata":' + orjson.dumps(
                {"format": fmt, "sample_rate_hz": rate, "frame_count": len(pcm), "channels": 1}
            )
        out.append((b'{"role":"assistant","content":"' + b64 + b'"}', meta))
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _audio_deltas(
    sample_rate: int, seconds: float, count: int, mode: str = "every", metadata: bool = True
) -> tuple[tuple[bytes, bytes], ...]:
    """Per chunk: the delta and its audio_metadata member (see :func:`_encode_pieces`)."""
    return _encode_pieces(_pcm_chunks(sample_rate, seconds, count), sample_rate, mode, metadata)


@functools.lru_cache(maxsize=16)
def _wav_file(path: str) -> tuple[np.ndarray, int]:
    data, rate = sf.read(path, dtype="int16", always_2d=True)
    return np.ascontiguousarray(data[:, 0]), int(rate)


@functools.lru_cache(maxsize=16)
def _file_audio_deltas(
    path: str, seconds: float, mode: str = "every", metadata: bool = True
) -> tuple[tuple[bytes, bytes], ...]:
    pcm, rate = _wav_file(path)
    step = max(1, round(seconds * rate))
    return _encode_pieces(tuple(pcm[i : i + step] for i in range(0, len(pcm), step)), rate, mode, metadata)


def _logprobs(piece: str, top: int | None) -> list[dict]:
    """vLLM's logprobs entries for one streamed piece (one token per piece), deterministic per text."""
    if top is None:
        return []
    lp = -round((sum(piece.encode()) % 97) / 97 * 3, 4)
    entry: dict[str, Any] = {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
    entry["top_logprobs"] = [
        {"token": piece if k == 0 else f"{piece}~{k}", "logprob": lp - k, "bytes": list(piece.encode())}
        for k in range(top)
    ]
    return [entry]


# --- the server -----------------------------------------------------------------------------------------


class _Progress:
    """Per-request bookkeeping, so an injected reset is not mistaken for a client abort."""

    __slots__ = ("aborted", "finished", "self_reset")

    def __init__(self) -> None:
        self.finished = False
        self.self_reset = False
        self.aborted = False


@dataclass(slots=True)
class _Plan:
    """What one chat request will be answered with."""

    script: Script
    rid: str
    created: int
    model: str
    pieces: tuple[str, ...]  # text pieces to send, already cut short by max_tokens
    text_finish: str
    n_audio: int
    audio_mode: str = "every"  # see _encode_pieces
    text_wanted: bool = True
    logprobs: int | None = None  # top_logprobs asked for (0 included); None: no logprobs
    n: int = 1  # answers asked for (non-streamed vLLM flavour)

    @property
    def rich(self) -> bool:
        s = self.script
        return s.flavour == "vllm" and bool(
            s.tool_calls or s.reasoning or self.logprobs is not None or self.n > 1
        )

    def tool_pieces(self) -> list[tuple[int, str, str, list[str]]]:
        """(index, id, name, argument pieces) of each scripted tool call."""
        s = self.script
        out = []
        for i, call in enumerate(s.tool_calls or ()):
            args = call.get("arguments", "")
            step = max(1, s.tool_chunk_chars)
            out.append(
                (
                    i,
                    f"chatcmpl-tool-{self.rid}-{i}",
                    call["name"],
                    [args[k : k + step] for k in range(0, len(args), step)] or [""],
                )
            )
        return out

    def chunk_head(self) -> bytes:
        """A chunk's JSON up to and including `"choices":`, shared by every chunk of the stream."""
        return (
            b'data: {"id":"' + self.rid.encode() + b'","object":"chat.completion.chunk","created":'
            + str(self.created).encode() + b',"model":' + orjson.dumps(self.model) + b',"choices":'
        )  # fmt: skip


def _error_body(message: str, type_: str, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


def _reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST, as a crashed engine or a proxy timeout would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _json_error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(
        status=status, body=_error_body(message, type_, status), content_type="application/json"
    )


def _segments(text: str, duration: float) -> list[dict[str, Any]]:
    """Whisper's segments of ``text``: one a sentence, the audio's time shared by their lengths."""
    sentences = [s.strip() + "." for s in text.rstrip(".").split(". ") if s.strip()] or [text]
    total = sum(len(s) for s in sentences) or 1
    out, at = [], 0.0
    for i, sentence in enumerate(sentences):
        end = round(at + duration * len(sentence) / total, 3)
        out.append(
            {"id": i, "seek": 0, "start": round(at, 3), "end": end, "text": " " + sentence, "tokens": [],
             "temperature": 0.0, "avg_logprob": -0.2, "compression_ratio": 1.0, "no_speech_prob": 0.01}
        )  # fmt: skip
        at = end
    return out


def _words(segment: dict[str, Any]) -> list[dict[str, Any]]:
    words = segment["text"].split()
    step = (segment["end"] - segment["start"]) / max(1, len(words))
    return [
        {
            "word": w,
            "start": round(segment["start"] + i * step, 3),
            "end": round(segment["start"] + (i + 1) * step, 3),
        }
        for i, w in enumerate(words)
    ]


def _subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    def stamp(t: float) -> str:
        ms = round(t * 1000)
        h, m, s = ms // 3_600_000, ms // 60_000 % 60, ms // 1000 % 60
        return f"{h:02d}:{m:02d}:{s:02d}{',' if fmt == 'srt' else '.'}{ms % 1000:03d}"

    cues = [f"{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text'].strip()}\n" for s in segments]
    if fmt == "srt":
        return "\n".join(f"{i + 1}\n{cue}" for i, cue in enumerate(cues))
    return "WEBVTT\n\n" + "\n".join(cues)


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


class ScriptedUpstream:
    """The server. Counters are plain attributes; `record=False` keeps long benchmark runs from growing."""

    def __init__(
        self,
        default: Script | None = None,
        *,
        models: list[str] | None = None,
        record: bool = True,
        keepalive_timeout: float = 75.0,
    ) -> None:
        self.keepalive_timeout = keepalive_timeout  # idle keep-alive connections are closed after this
        self.default: Script = default or Script()
        self.models: list[str] = list(models or ["scripted"])
        #: /v1/models' ``root`` per model id (vLLM lists the --model it loaded there); default: the id
        self.roots: dict[str, str] = {}
        self.models_status = (
            200  # GET /v1/models' status (another: an engine whose model list cannot be read)
        )
        self.record = record
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.voices: list[str | None] = []
        #: each /v1/audio/transcriptions form as it arrived: its fields, and "file": (name, type, bytes)
        self.transcriptions: list[dict[str, Any]] = []
        #: vLLM-Omni's own realtime socket (tests/realtime_engine.py): its script and what it saw
        self.realtime = RealtimeEngine()
        self.request_count = 0
        self.last_body_bytes = 0  # the size of the last chat request's body, as it arrived
        self.completed = 0
        self.aborts = 0
        self.abort_event = asyncio.Event()
        self.abort_times: list[float] = []  # time.monotonic() of each abort, for latency figures
        self.errors = 0  # scripted 500/503 replies
        self.resets = 0  # scripted connection resets
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections: set[tuple[str, int]] = set()  # client (host, port) pairs chat requests came on
        # /metrics gauges; num_requests_running None means "report in_flight".
        self.num_requests_running: float | None = None
        self.num_requests_waiting: float = 0.0
        self.kv_cache_usage_perc: float = 0.0
        # A DCGM exporter's framebuffer gauges (MiB) for GPU "0", served on /metrics when set.
        self.gpu_fb_used_mib: float | None = None
        self.gpu_fb_free_mib: float | None = None
        # vLLM-Omni: the talker's speakers (an unknown voice is a 400, as the model config's speaker_id decides);
        # GET /health's status (503: the engine is dead while /v1/models still answers; 404: no such route);
        # per-stage metrics as vLLM-Omni relabels vLLM's (stage id, "0" the thinker, -> {"running", "waiting",
        # "kv", "ttft": [seconds]}).
        self.speakers: list[str] = ["aiden", "chelsie", "ethan"]
        self.health_status = 200
        self.stage_metrics: dict[str, dict[str, Any]] | None = None
        # vLLM-Omni's sleep mode (--enable-sleep-mode; off: its routes answer 501): the sleeping stages and their
        # levels, the stages its vllm:engine_sleep_state series are exported for, how long after a wakeup the
        # gauge still reads asleep (vLLM updates it from its stats logger), and the control calls it saw.
        self.sleep_mode = True
        self.sleeping_stages: dict[int, int] = {}
        self.sleep_gauge_stages: list[int] = [0, 1, 2]
        self.wake_delay_s = 0.0
        self.sleep_calls: list[tuple[str, dict]] = []
        self._woken_at: dict[int, float] = {}
        self._queue: list[Script] = []
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._host = "127.0.0.1"

    # -- lifecycle

    async def _realtime(self, request: web.Request) -> web.WebSocketResponse:
        return await self.realtime.handle(request)  # the engine of the moment: tests replace it

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)  # a 40 min segment as WAV is 77 MB
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/audio/transcriptions", self._transcriptions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/realtime", self._realtime)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/omni/sleep", self._omni_sleep)
        app.router.add_post("/v1/omni/wakeup", self._omni_wakeup)
        app.router.add_post("/_script", self._set_script)
        app.router.add_post("/_enqueue", self._enqueue)
        app.router.add_post("/_metrics", self._set_metrics)
        app.router.add_post("/_reset", self._reset_stats)
        app.router.add_get("/_stats", self._stats)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> ScriptedUpstream:
        # handler_cancellation: aiohttp then cancels a handler the moment its connection is lost, which is
        # what lets abort_event fire while the handler sleeps between chunks (no polling needed).
        self._runner = web.AppRunner(
            self.make_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
            keepalive_timeout=self.keepalive_timeout,
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
        site = web.SockSite(self._runner, sock, backlog=1024)
        await site.start()
        self._host, self._port = host, sock.getsockname()[1]
        self._stopping = False
        return self

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedUpstream:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("ScriptedUpstream is not started")
        return self._port

    @property
    def base_url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/v1"

    # -- scripting

    def enqueue(self, *scripts: Script) -> None:
        self._queue.extend(scripts)

    def clear_queue(self) -> None:
        self._queue.clear()

    def reset_stats(self) -> None:
        self.requests.clear()
        self.headers.clear()
        self.voices.clear()
        self.transcriptions.clear()
        self.request_count = self.completed = self.aborts = self.errors = self.resets = 0
        self.last_body_bytes = 0
        self.max_in_flight = self.in_flight
        self.connections.clear()
        self.abort_event.clear()
        self.abort_times.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.request_count,
            "completed": self.completed,
            "aborts": self.aborts,
            "errors": self.errors,
            "resets": self.resets,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "connections": len(self.connections),
            "queued": len(self._queue),
            "last_voice": self.voices[-1] if self.voices else None,
            "last_body_bytes": self.last_body_bytes,
        }

    # -- chat

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        state = _Progress()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if peer is not None:
            self.connections.add(tuple(peer[:2]))
        try:
            return await self._serve_chat(request, state)
        except asyncio.CancelledError:
            # Cancelled by aiohttp on connection loss (handler_cancellation) or by stop().
            if not (self._stopping or state.finished or state.self_reset):
                self._count_abort(state)
            raise
        finally:
            self.in_flight -= 1
            self._tasks.discard(task)

    def _count_abort(self, state: _Progress) -> None:
        if not state.aborted:
            state.aborted = True
            self.aborts += 1
            self.abort_times.append(time.monotonic())
            self.abort_event.set()

    async def _serve_chat(self, request: web.Request, state: _Progress) -> web.StreamResponse:
        raw = await request.read()
        self.last_body_bytes = len(raw)
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as exc:
            return web.Response(
                status=400,
                body=_error_body(f"invalid JSON body: {exc}", "BadRequestError", 400),
                content_type="application/json",
            )
        self.request_count += 1
        voice = body.get("voice") or body.get("speaker")
        if self.record:
            self.requests.append(body)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            self.voices.append(voice)
        script = self._queue.pop(0) if self._queue else self.default
        script = _constrained(script, body.get("response_format"))

        fault = script.fault
        if fault == "reset_before_first_byte":
            state.self_reset = True
            self.resets += 1
            _reset(request)
            return web.Response()  # aiohttp finds the transport closed and drops this quietly
        if fault == "hang_before_first_byte":
            await _forever()
        if script.first_byte_delay_s > 0:
            await asyncio.sleep(script.first_byte_delay_s)
        if fault == "500_before_headers":
            self.errors += 1
            state.finished = True
            return web.Response(
                status=500,
                body=orjson.dumps(script.status_body)
                if script.status_body is not None
                else _error_body("scripted upstream failure", "InternalServerError", 500),
                content_type="application/json",
            )
        if fault == "400_before_headers" and script.flavour == "omni" and script.status_body is None:
            # What a real vLLM-Omni 0.30.0 answers the same prompt, stream or not: vLLM's words, but as a 500.
            self.errors += 1
            state.finished = True
            return web.Response(
                status=500,
                body=_error_body(
                    "This model's maximum context length is 2048 tokens. However, you requested 4 output tokens "
                    "and your prompt contains at least 2045 input tokens, for a total of at least 2049 tokens. "
                    "Please reduce the length of the input prompt or the number of requested output tokens. "
                    "(parameter=input_tokens, value=2045)",
                    "Internal Server Error",
                    500,
                ),
                content_type="application/json",
            )
        if fault == "400_before_headers":
            # What vLLM answers a prompt longer than its context, even for a stream: a JSON 400.
            self.errors += 1
            state.finished = True
            return web.Response(
                status=400,
                body=orjson.dumps(script.status_body)
                if script.status_body is not None
                else _error_body(
                    "This model's maximum context length is 2048 tokens. However, you requested 4109 tokens "
                    "(4000 in the messages, 109 in the completion). Please reduce the length of the messages "
                    "or completion.",
                    "BadRequestError",
                    400,
                ),
                content_type="application/json",
            )
        if fault == "503_retry_after":
            self.errors += 1
            state.finished = True
            return web.Response(
                status=503,
                headers={"Retry-After": "2"},
                body=orjson.dumps(script.status_body)
                if script.status_body is not None
                else _error_body("scripted upstream overloaded", "ServiceUnavailableError", 503),
                content_type="application/json",
            )

        model = body.get("model") if isinstance(body.get("model"), str) else self.models[0]
        modalities = body.get("modalities") or ["text"]
        want_audio = script.flavour == "omni" and isinstance(modalities, list) and "audio" in modalities
        if script.flavour == "omni" and isinstance(voice, str) and voice.lower() not in self.speakers:
            # vLLM-Omni checks the speaker before any generation, also for a stream: a JSON 400, no SSE.
            return web.Response(
                status=400,
                body=_error_body(
                    f"Invalid speaker '{voice}'. Supported: {', '.join(sorted(self.speakers))}",
                    "BadRequestError",
                    400,
                ),
                content_type="application/json",
            )
        asked = (body.get("audio") or {}).get("format") if isinstance(body.get("audio"), dict) else None
        audio_mode = "pcm" if asked in ("pcm", "pcm16") else script.omni_wav_headers
        pieces = _text_pieces(script.text, script.chunk_words)
        text_finish = "stop"
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if (
            isinstance(limit, int)
            and not isinstance(limit, bool)
            and 0 < limit < len(pieces)
            and not script.ignore_max_tokens
        ):
            pieces, text_finish = pieces[:limit], "length"
        plan = _Plan(
            script=script,
            rid=f"chatcmpl-scripted-{next(self._ids)}",
            created=int(time.time()),
            model=model,
            pieces=pieces,
            text_finish="tool_calls" if script.tool_calls else text_finish,
            n_audio=script.n_audio_chunks if want_audio else 0,
            audio_mode=audio_mode,
            text_wanted=not isinstance(modalities, list) or "text" in modalities,
            logprobs=(body.get("top_logprobs") or 0) if body.get("logprobs") else None,
            n=body["n"] if isinstance(body.get("n"), int) and script.flavour == "vllm" else 1,
        )
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, state, plan, include_usage)
        return await self._complete(request, state, plan)

    @staticmethod
    def _rich_frames(plan: _Plan) -> list[bytes]:
        """vLLM's stream with reasoning, tool calls or logprobs, one JSON document per frame."""
        script = plan.script
        head = plan.chunk_head()

        def frame(delta: dict, finish: str | None = None, logprobs: list | None = None) -> bytes:
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs else None,
                "finish_reason": finish,
            }
            return head + orjson.dumps([choice]) + b"}\n\n"

        frames = [frame({"role": "assistant", "content": ""})]
        if script.reasoning:
            frames += [frame({script.reasoning_key: p}) for p in _text_pieces(script.reasoning, 1)]
        for piece in plan.pieces:
            frames.append(frame({"content": piece}, logprobs=_logprobs(piece, plan.logprobs)))
        for index, call_id, name, args in plan.tool_pieces():
            frames.append(
                frame(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            )
            frames += [frame({"tool_calls": [{"index": index, "function": {"arguments": a}}]}) for a in args]
        frames.append(frame({"content": ""}, finish=plan.text_finish))
        if plan.n > 1:
            # vLLM streams each choice under its own index, interleaved; choice i says the text and " [i]".
            streams = [frames]
            for i in range(1, plan.n):

                def other(delta: dict, finish: str | None = None, i: int = i) -> bytes:
                    choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
                    return head + orjson.dumps([choice]) + b"}\n\n"

                own = [other({"role": "assistant", "content": ""})]
                own += [other({"content": p}) for p in (*plan.pieces, f" [{i}]")]
                own.append(other({"content": ""}, finish=plan.text_finish))
                streams.append(own)
            frames = [f for group in itertools.zip_longest(*streams) for f in group if f is not None]
        return frames

    def _completion_tokens(self, plan: _Plan) -> int:
        one = (
            len(plan.pieces)
            + sum(len(a) for *_, a in plan.tool_pieces())
            + (len(_text_pieces(plan.script.reasoning, 1)) if plan.script.reasoning else 0)
        )
        return one * plan.n + (plan.n - 1)  # each further choice also says " [i]"

    @staticmethod
    def _frames(plan: _Plan) -> list[bytes]:
        if plan.rich:
            return ScriptedUpstream._rich_frames(plan)
        script = plan.script
        omni = script.flavour == "omni"
        head = plan.chunk_head() + b'[{"index":0,"delta":'
        # vLLM's extras, which vLLM-Omni leaves on every chunk: on the choice, and at the top level.
        choice_extra = b',"stop_reason":null,"token_ids":[0]' if omni else b""
        top_extra = b',"prompt_token_ids":null,"metrics":{"num_tokens_out":1}' if omni else b""
        text_tail = choice_extra + b"}]" + (b',"modality":"text"' + top_extra if omni else b"") + b"}\n\n"
        null = b',"logprobs":null,"finish_reason":null'
        deltas = _text_deltas(script.text, script.chunk_words)[: len(plan.pieces)] or (b'{"content":""}',)
        frames = [head + b'{"role":"assistant","content":""}' + null + text_tail]
        frames += [head + d + null + text_tail for d in deltas[:-1]]
        # With speech, vLLM-Omni's last text chunk carries no finish_reason: the last audio chunk carries the stop.
        text_finish = b"null" if omni and plan.n_audio else b'"' + plan.text_finish.encode() + b'"'
        frames.append(head + deltas[-1] + b',"logprobs":null,"finish_reason":' + text_finish + text_tail)
        if plan.n_audio:
            p = script.prompt_tokens
            usage = orjson.dumps({"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p})
            audio_tail = choice_extra + b'}],"usage":' + usage + b',"modality":"audio"' + top_extra + b"}\n\n"
            mode, meta_on = plan.audio_mode, script.omni_audio_metadata
            if script.audio_wav is not None:
                chunks = _file_audio_deltas(script.audio_wav, script.audio_seconds_per_chunk, mode, meta_on)
            else:
                chunks = _audio_deltas(
                    script.sample_rate, script.audio_seconds_per_chunk, plan.n_audio, mode, meta_on
                )
            audio = []
            for i, (delta, meta) in enumerate(chunks):
                last = i == plan.n_audio - 1 and not script.omni_bare_finish
                finish = b',"logprobs":null,"finish_reason":' + (b'"stop"' if last else b"null")
                audio.append(head + delta + finish + meta + audio_tail)
            if script.audio_interleave > 0:
                text, frames = frames, [frames[0]]
                for i, frame in enumerate(text[1:], start=1):
                    frames.append(frame)
                    # The stop rides on the last audio chunk, which a talker can only send after the text ended.
                    if i % script.audio_interleave == 0 and len(audio) > 1 and i < len(text) - 1:
                        frames.append(audio.pop(0))
            frames += audio
            if script.omni_bare_finish:
                frames.append(head + b'{},"logprobs":null,"finish_reason":"stop"}]}\n\n')
        return frames

    async def _stream(
        self, request: web.Request, state: _Progress, plan: _Plan, include_usage: bool
    ) -> web.StreamResponse:
        script = plan.script
        frames = self._frames(plan)
        tail = b""
        if include_usage:
            n = self._completion_tokens(plan)
            usage = {"prompt_tokens": script.prompt_tokens, "completion_tokens": n,
                     "total_tokens": script.prompt_tokens + n}  # fmt: skip
            # vLLM-Omni's usage chunk is the one chunk without a modality; it counts text tokens only.
            tail = plan.chunk_head() + b'[],"usage":' + orjson.dumps(usage) + b"}\n\n"
        tail += b"data: [DONE]\n\n"

        fault = script.fault
        delay = _DRIP_INTERVAL_S if fault == "drip" else script.chunk_delay_s
        fault_at = min(max(0, script.fault_after_chunks), len(frames))
        mid_fault = fault in ("reset_mid_stream", "hang_mid_stream", "malformed_json", "error_mid_stream")

        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        try:
            await resp.prepare(request)
            if mid_fault and fault_at == 0:
                request.writer.send_headers()  # aiohttp otherwise holds headers back for the first body write
            for i, frame in enumerate(frames):
                if mid_fault and i == fault_at and await self._mid_fault(request, state, resp, fault):
                    return resp
                if i and delay > 0:
                    await asyncio.sleep(delay)
                await resp.write(frame)
            if mid_fault and fault_at == len(frames) and await self._mid_fault(request, state, resp, fault):
                return resp
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(tail)
            state.finished = True
            self.completed += 1
            if script.eof_delay_s > 0:
                await asyncio.sleep(script.eof_delay_s)
            await resp.write_eof()
        except ConnectionResetError:
            # The client left between our last await and this write; aiohttp has not cancelled us yet.
            if not (state.finished or state.self_reset):
                self._count_abort(state)
        return resp

    async def _mid_fault(
        self, request: web.Request, state: _Progress, resp: web.StreamResponse, fault: str
    ) -> bool:
        """Apply a mid-stream fault; True when the stream must end here."""
        if fault == "error_mid_stream":
            # What vLLM sends when generation fails after the stream began: an error event, then the end.
            await resp.write(
                b"data: "
                + _error_body("engine failure mid-stream", "InternalServerError", 500)
                + b"\n\ndata: [DONE]\n\n"
            )
            state.finished = True
            return True
        if fault == "malformed_json":
            await resp.write(b"data: {not json\n\n")
            return False
        if fault == "hang_mid_stream":
            await _forever()
        # reset_mid_stream. Give what was written a moment to be read: after an RST, clients such as aiohttp
        # raise on the next read and discard what they had buffered.
        await asyncio.sleep(0.02)
        state.self_reset = True
        self.resets += 1
        _reset(request)
        return True

    async def _complete(self, request: web.Request, state: _Progress, plan: _Plan) -> web.StreamResponse:
        script, fault = plan.script, plan.script.fault
        # A non-streamed reply still takes as long as generating every chunk would.
        delay = _DRIP_INTERVAL_S if fault == "drip" else script.chunk_delay_s
        if fault == "hang_mid_stream":
            await _forever()
        if delay > 0:
            await asyncio.sleep(delay * (len(plan.pieces) + plan.n_audio))
        if fault == "reset_mid_stream":
            state.self_reset = True
            self.resets += 1
            _reset(request)
            return web.Response()
        if fault == "malformed_json":
            state.finished = True
            self.completed += 1
            return web.Response(body=b"{not json", content_type="application/json")

        n = self._completion_tokens(plan)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(plan.pieces), "tool_calls": []}
        # vLLM-Omni's text stage answers with vLLM's own message (its serving_chat builds vLLM's ChatMessage,
        # tool calls and reasoning included), so the non-streamed omni flavour carries them as vLLM does.
        if plan.rich or (script.flavour == "omni" and (script.tool_calls or script.reasoning)):
            message["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": "".join(args)}}
                for _, call_id, name, args in plan.tool_pieces()
            ]
            if script.tool_calls and not plan.pieces:
                message["content"] = None
            if script.reasoning:
                message[script.reasoning_key] = script.reasoning
        logprobs = None
        if plan.logprobs is not None:
            logprobs = {"content": [e for p in plan.pieces for e in _logprobs(p, plan.logprobs)]}
        choices: list[dict[str, Any]] = [
            {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": plan.text_finish}
        ]
        # vLLM answers n > 1 with one choice per index; here each further one is the text marked " [i]",
        # listed last index first: a client must read `index`, not the position.
        for i in range(plan.n - 1, 0, -1):
            alt = {**message, "content": (message["content"] or "") + f" [{i}]"}
            choices.append({"index": i, "message": alt, "logprobs": None, "finish_reason": plan.text_finish})
        if plan.n_audio:
            if script.audio_wav is not None:
                pcm, rate = _wav_file(script.audio_wav)
            else:
                rate = script.sample_rate
                pcm = np.concatenate(_pcm_chunks(rate, script.audio_seconds_per_chunk, plan.n_audio))
            raw = pcm.astype("<i2").tobytes() if plan.audio_mode == "pcm" else _wav(pcm, rate)
            audio = {
                "id": f"audio-{plan.rid}",
                "data": base64.b64encode(raw).decode(),
                "expires_at": plan.created + 3600,
                "transcript": "",
            }  # vLLM-Omni leaves it empty
            meta = {
                "format": "pcm" if plan.audio_mode == "pcm" else "wav",
                "sample_rate_hz": rate,
                "frame_count": len(pcm),
                "channels": 1,
            }
            audio_choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": None, "audio": audio},
                "logprobs": None,
                "finish_reason": "stop",
            }
            if script.omni_audio_metadata:
                audio_choice["audio_metadata"] = meta
            if not plan.text_wanted:
                choices = [audio_choice]
            elif script.omni_choices == "merged":
                # 0.30.0: one choice, the text stage's finish_reason, the audio beside the content.
                choices[0]["message"]["audio"] = audio
                if script.omni_audio_metadata:
                    choices[0]["audio_metadata"] = meta
            elif script.omni_choices == "split":
                choices.append(audio_choice)  # older builds: both index 0, in the order the stages finished
            else:
                choices.insert(0, audio_choice)
        payload = {
            "id": plan.rid,
            "object": "chat.completion",
            "created": plan.created,
            "model": plan.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": script.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": script.prompt_tokens + n,
            },
        }
        state.finished = True
        self.completed += 1
        return web.Response(body=orjson.dumps(payload), content_type="application/json")

    # -- speech to text (vLLM serving Whisper: OpenAI's multipart wire)

    async def _transcriptions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/transcriptions``: the script's text is the transcript, in the form's
        ``response_format`` (json, text, verbose_json, srt, vtt); the faults before the first byte are
        chat's (vLLM's 400 JSON, a 500, a 503 with ``Retry-After``, a reset, a hang, malformed JSON)."""
        try:
            form = await request.post()
        except ValueError as exc:
            return _json_error(400, f"invalid multipart body: {exc}", "BadRequestError")
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            return _json_error(400, "file: field required", "BadRequestError")
        data = upload.file.read()
        fields: dict[str, Any] = {}
        for key, value in form.items():
            if isinstance(value, str) and key.endswith("[]"):
                fields.setdefault(key, []).append(value)  # an array field: each value its own part
            elif isinstance(value, str):
                fields[key] = value
        self.request_count += 1
        if self.record:
            self.transcriptions.append({**fields, "file": (upload.filename, upload.content_type, data)})
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        script = self._queue.pop(0) if self._queue else self.default
        fault = script.fault
        if fault in ("reset_before_first_byte", "reset_mid_stream"):
            self.resets += 1
            _reset(request)
            return web.Response()
        if fault in ("hang_before_first_byte", "hang_mid_stream"):
            await _forever()
        if script.first_byte_delay_s > 0:
            await asyncio.sleep(script.first_byte_delay_s)
        if fault in ("500_before_headers", "503_retry_after", "400_before_headers"):
            self.errors += 1
            status = int(fault[:3])
            if script.status_body is not None:
                body = orjson.dumps(script.status_body)
            else:
                body = _error_body(
                    {500: "scripted upstream failure", 503: "scripted upstream overloaded"}.get(
                        status, "Maximum clip duration (30s) exceeded"
                    ),
                    {500: "InternalServerError", 503: "ServiceUnavailableError"}.get(
                        status, "BadRequestError"
                    ),
                    status,
                )
            headers = {"Retry-After": "2"} if status == 503 else None
            return web.Response(status=status, body=body, headers=headers, content_type="application/json")
        if fault == "malformed_json":
            self.completed += 1
            return web.Response(body=b"{not json", content_type="application/json")
        fmt = str(fields.get("response_format") or "json")
        if fmt not in ("json", "text", "verbose_json", "srt", "vtt"):
            return _json_error(400, f"Unsupported response_format {fmt!r}", "BadRequestError")
        try:
            duration = round(sf.info(io.BytesIO(data)).duration, 3)
        except (RuntimeError, sf.LibsndfileError):
            return _json_error(400, "Invalid or unsupported audio file.", "BadRequestError")
        self.completed += 1
        text = script.text
        segments = _segments(text, duration)
        if fmt == "text":
            return web.Response(text=text, content_type="text/plain")
        if fmt in ("srt", "vtt"):
            return web.Response(text=_subtitles(segments, fmt), content_type="text/plain")
        usage = {"type": "duration", "seconds": math.ceil(duration)}
        if fmt == "json":
            return web.Response(
                body=orjson.dumps({"text": text, "usage": usage}), content_type="application/json"
            )
        granularities = fields.get("timestamp_granularities[]") or ["segment"]
        doc: dict[str, Any] = {
            "task": "transcribe",
            "language": fields.get("language") or "english",
            "duration": duration,
            "text": text,
            "usage": usage,
        }
        if "segment" in granularities:
            doc["segments"] = segments
        if "word" in granularities:
            doc["words"] = [w for s in segments for w in _words(s)]
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    # -- other endpoints

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200:
            return web.Response(status=self.models_status, body=_error_body("no models", "server_error", 500))
        now = int(time.time())
        data = [
            {
                "id": m,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": self.roots.get(m, m),
                "parent": None,
            }
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data}, dumps=lambda o: orjson.dumps(o).decode())

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        label = '{model_name="' + self.models[0].replace("\\", "\\\\").replace('"', '\\"') + '"}'
        running = self.in_flight if self.num_requests_running is None else self.num_requests_running
        waiting, kv = self.num_requests_waiting, self.kv_cache_usage_perc
        lines = []
        if self.stage_metrics is not None:
            lines += self._stage_lines(running, waiting, kv)
        for name, help_, value in (
            ()
            if self.stage_metrics is not None
            else (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv),
            )
        ):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{label} {float(value)!r}"]
        gpu = '{gpu="0",UUID="GPU-scripted",device="nvidia0",Hostname="scripted"}'
        for name, help_, value in (
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", self.gpu_fb_used_mib),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", self.gpu_fb_free_mib),
        ):
            if value is not None:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{gpu} {float(value)!r}"]
        lines += self._sleep_lines()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    # -- vLLM-Omni sleep mode: POST /v1/omni/sleep and /v1/omni/wakeup, the vllm:engine_sleep_state gauge

    @staticmethod
    def _invalid(loc: str, msg: str, value: Any) -> web.Response:
        detail = [{"type": "value_error", "loc": ["body", loc], "msg": msg, "input": value}]
        return web.json_response({"detail": detail}, status=422)

    async def _control_body(self, request: web.Request, with_level: bool) -> dict | web.Response:
        """Validated as vLLM-Omni's OmniSleepRequest/OmniWakeupRequest: stage_ids a non-empty list of ints,
        level an int >= 0 (default 2)."""
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return self._invalid("body", "JSON decode error", None)
        if not isinstance(body, dict):
            return self._invalid("body", "Input should be a valid dictionary", body)
        ids = body.get("stage_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return self._invalid("stage_ids", "Input should be a valid list of integers", ids)
        if not ids:
            return self._invalid("stage_ids", "List should have at least 1 item after validation, not 0", ids)
        out: dict = {"stage_ids": ids}
        if with_level:
            level = body.get("level", 2)
            if not isinstance(level, int) or isinstance(level, bool) or level < 0:
                return self._invalid("level", "Input should be greater than or equal to 0", level)
            out["level"] = level
        return out

    @staticmethod
    def _acks(stage_ids: list[int]) -> list[dict]:
        return [
            {
                "task_id": f"ack-{sid}",
                "status": "ok",
                "stage_id": sid,
                "rank": 0,
                "freed_bytes": 0,
                "metadata": {},
            }
            for sid in stage_ids
        ]

    async def _omni_sleep(self, request: web.Request) -> web.Response:
        if not self.sleep_mode:
            return web.json_response({"detail": "The engine does not support sleep mode"}, status=501)
        body = await self._control_body(request, with_level=True)
        if isinstance(body, web.Response):
            return body
        self.sleep_calls.append(("sleep", body))
        for sid in body["stage_ids"]:
            self.sleeping_stages[sid] = body["level"]
            self._woken_at.pop(sid, None)
        return web.json_response({"status": "SUCCESS", "acks": self._acks(body["stage_ids"])})

    async def _omni_wakeup(self, request: web.Request) -> web.Response:
        if not self.sleep_mode:
            return web.json_response({"detail": "The engine does not support wake_up"}, status=501)
        body = await self._control_body(request, with_level=False)
        if isinstance(body, web.Response):
            return body
        self.sleep_calls.append(("wakeup", body))
        asleep = [sid for sid in body["stage_ids"] if sid in self.sleeping_stages]
        if not asleep:
            return web.json_response({"status": "SKIPPED"})
        now = time.monotonic()
        for sid in asleep:
            self._woken_at[sid] = now + self.wake_delay_s
        return web.json_response({"status": "SUCCESS", "acks": self._acks(asleep)})

    def sleep_level(self, stage: int) -> int:
        """0 awake, else the stage's sleep level, as the gauge reads now (a wake shows after wake_delay_s)."""
        until = self._woken_at.get(stage)
        if until is not None and time.monotonic() >= until:
            self.sleeping_stages.pop(stage, None)
            self._woken_at.pop(stage, None)
        return self.sleeping_stages.get(stage, 0)

    def _sleep_lines(self) -> list[str]:
        name = "vllm:engine_sleep_state"
        model = self.models[0].replace("\\", "\\\\").replace('"', '\\"')
        lines = [
            f"# HELP {name} Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            f"# TYPE {name} gauge",
        ]
        for stage in self.sleep_gauge_stages:
            level = self.sleep_level(stage)
            current = {0: "awake", 1: "weights_offloaded"}.get(level, "discard_all")
            for state in ("awake", "weights_offloaded", "discard_all"):
                labels = f'model_name="{model}",stage="{stage}",replica="0",sleep_state="{state}"'
                lines.append(f"{name}{{{labels}}} {1.0 if state == current else 0.0!r}")
        return lines

    _TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def _stage_lines(self, running: float, waiting: float, kv: float) -> list[str]:
        """vLLM-Omni's exposition (with --log-stats): its own vllm_omni:* series, and vLLM's per stage and replica."""
        assert self.stage_metrics is not None
        model = self.models[0].replace("\\", "\\\\").replace('"', '\\"')
        lines = [
            "# HELP vllm_omni:num_requests_running Requests in the omni pipeline.",
            "# TYPE vllm_omni:num_requests_running gauge",
            f'vllm_omni:num_requests_running{{model_name="{model}"}} {float(running)!r}',
            "# HELP vllm_omni:num_requests_waiting Requests waiting to enter the omni pipeline.",
            "# TYPE vllm_omni:num_requests_waiting gauge",
            f'vllm_omni:num_requests_waiting{{model_name="{model}"}} {float(waiting)!r}',
        ]
        for name, key, default in (
            ("vllm:num_requests_running", "running", running),
            ("vllm:num_requests_waiting", "waiting", waiting),
            ("vllm:kv_cache_usage_perc", "kv", kv),
        ):
            lines += [f"# HELP {name} {name}", f"# TYPE {name} gauge"]
            for stage, values in self.stage_metrics.items():
                labels = f'model_name="{model}",stage="{stage}",replica="0"'
                lines.append(f"{name}{{{labels}}} {float(values.get(key, default))!r}")
        hist = "vllm:time_to_first_token_seconds"
        lines += [f"# HELP {hist} Histogram of time to first token in seconds.", f"# TYPE {hist} histogram"]
        for stage, values in self.stage_metrics.items():
            seen = [float(v) for v in values.get("ttft", [])]
            labels = f'model_name="{model}",stage="{stage}",replica="0"'
            for b in self._TTFT_BOUNDS:
                lines.append(f'{hist}_bucket{{{labels},le="{b}"}} {float(sum(v <= b for v in seen))!r}')
            lines.append(f'{hist}_bucket{{{labels},le="+Inf"}} {float(len(seen))!r}')
            lines += [
                f"{hist}_count{{{labels}}} {float(len(seen))!r}",
                f"{hist}_sum{{{labels}}} {sum(seen)!r}",
            ]
        return lines

    async def _set_script(self, request: web.Request) -> web.Response:
        try:
            self.default = Script.from_dict(await request.json(loads=orjson.loads))
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(dataclasses.asdict(self.default))

    async def _enqueue(self, request: web.Request) -> web.Response:
        try:
            data = await request.json(loads=orjson.loads)
            scripts = [Script.from_dict(d) for d in (data if isinstance(data, list) else [data])]
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.enqueue(*scripts)
        return web.json_response({"queued": len(self._queue)})

    async def _set_metrics(self, request: web.Request) -> web.Response:
        data = await request.json(loads=orjson.loads)
        for key in (
            "num_requests_running",
            "num_requests_waiting",
            "kv_cache_usage_perc",
            "gpu_fb_used_mib",
            "gpu_fb_free_mib",
        ):
            if key in data:
                setattr(self, key, data[key])
        return web.json_response({"ok": True})

    async def _reset_stats(self, request: web.Request) -> web.Response:
        self.reset_stats()
        return web.json_response(self.stats())

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())


# --- structured output --------------------------------------------------------------------------------------


def _instance(schema: dict[str, Any]) -> Any:
    """The smallest value ``schema`` accepts (the subset of JSON Schema the gateway's own requests use)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return {k: _instance(props[k]) for k in schema.get("required", list(props))}
    if kind == "array":
        return [_instance(schema.get("items", {})) for _ in range(schema.get("minItems", 0))]
    return {"string": "", "integer": 0, "number": 0, "boolean": False, "null": None}.get(kind)


def _constrained(script: Script, response_format: Any) -> Script:
    """What vLLM's structured output guarantees: an answer that matches the request's JSON schema. A script
    whose text already does is sent as it is; another is replaced by the smallest matching value."""
    if script.ignore_response_format or not isinstance(response_format, dict):
        return script
    if response_format.get("type") != "json_schema":
        return script
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        return script
    import jsonschema

    try:
        jsonschema.validate(orjson.loads(script.text), schema)
        return script
    except (orjson.JSONDecodeError, jsonschema.ValidationError):
        return dataclasses.replace(script, text=orjson.dumps(_instance(schema)).decode(), chunk_words=10**6)


# --- CLI --------------------------------------------------------------------------------------------------


def _script_from_args(args: argparse.Namespace) -> Script:
    text = args.text if args.text is not None else Script.text
    if args.chunks is not None:
        # Exactly N text pieces: cycle the text's words to length N.
        words = text.split() or ["word"]
        text = " ".join(itertools.islice(itertools.cycle(words), args.chunks))
    return Script(
        flavour=args.flavour,
        text=text,
        audio_chunks=args.audio_chunks,
        sample_rate=args.sample_rate,
        first_byte_delay_s=args.first_byte_delay_ms / 1000.0,
        chunk_delay_s=args.chunk_delay_ms / 1000.0,
        fault=args.fault,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.upstream", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--flavour", choices=sorted(_FLAVOURS), default="vllm")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0)
    p.add_argument("--first-byte-delay-ms", type=float, default=0.0)
    p.add_argument("--text", default=None)
    p.add_argument("--chunks", type=int, default=None, help="number of text pieces (cycles the text's words)")
    p.add_argument("--audio-chunks", type=int, default=None)
    p.add_argument("--sample-rate", type=int, default=24000)
    p.add_argument("--fault", choices=sorted(f for f in _FAULTS if f), default=None)
    p.add_argument("--models", default="scripted", help="comma-separated model ids for /v1/models")
    p.add_argument("--record", action="store_true", help="keep request bodies and headers in memory")
    args = p.parse_args(argv)

    async def run() -> None:
        up = ScriptedUpstream(
            _script_from_args(args), models=[m for m in args.models.split(",") if m], record=args.record
        )
        await up.start(args.host, args.port)
        print(f"scripted upstream ({args.flavour}) listening on {up.base_url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await up.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
