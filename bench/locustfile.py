"""The deployment's mixed workload for Locust, streamed through the OpenAI API, against its thresholds.

    locust -f bench/locustfile.py --headless -u 8 -r 8 -t 3m --host http://127.0.0.1:8080 \\
        --text-model qwen3-omni-flash --omni-model qwen3-omni-flash --summary-json out.json

Each request is one of four kinds, drawn by ``--weights`` (default ``text=4,image=2,audio=2,speech=2``):
``text`` (a text prompt), ``image`` (a PNG and a question), ``audio`` (a WAV clip and a question),
``speech`` (a text prompt answered in text and speech). ``text`` goes to ``--text-model``, the others
to ``--omni-model`` (a text-only model cannot take media: point those at one that can, or weight them 0).

Besides one request entry per kind (``chat <kind>``, the whole stream), two custom entries record what
the deployment's thresholds are about: ``TTFT <kind>`` (from sending the request to the first chunk with
text: ``delta.content``, or with speech the audio's transcript) and ``first-audio <kind>`` (to the first
chunk carrying audio data). At the end the summary JSON holds req/s, the TTFT and first-packet
percentiles (exact, from every sample of this process: run it without ``--processes``), the gateway's
own engine-true TTFT P99 from its ``/metrics`` where it is reachable, and each figure against its
target (10 req/s at 8 users, TTFT < 234 ms, first packet P99 < 300 ms). The targets are the GPU
deployment's; the summary records the figures, it does not fail the run on them.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
import struct
import time
import wave
import zlib
from pathlib import Path
from typing import Any

from locust import HttpUser, events, task
from locust.env import Environment

TARGETS = {"req_per_s": 10.0, "users": 8, "ttft_ms": 234.0, "first_audio_p99_ms": 300.0}
KINDS = ("text", "image", "audio", "speech")
ENGINE_TTFT = "omnigate_engine_time_to_first_token_seconds"


# -- the workload's media, made here (no files to ship) ---------------------------------------------------
def _png(width: int = 64, height: int = 48) -> bytes:
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in ((x * 4) % 256, (y * 5) % 256, 128))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def _wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    frames = b"".join(
        struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
        for i in range(int(seconds * rate))
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


IMAGE_URL = "data:image/png;base64," + base64.b64encode(_png()).decode()
AUDIO_B64 = base64.b64encode(_wav()).decode()


def messages(kind: str) -> list[dict[str, Any]]:
    if kind == "image":
        content: Any = [
            {"type": "text", "text": "What colours are in this picture?"},
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        ]
    elif kind == "audio":
        content = [
            {"type": "text", "text": "What do you hear in this clip?"},
            {"type": "input_audio", "input_audio": {"data": AUDIO_B64, "format": "wav"}},
        ]
    elif kind == "speech":
        content = "Say a short greeting."
    else:
        content = "Name three colours of the rainbow."
    return [{"role": "user", "content": content}]


def parse_weights(text: str) -> dict[str, float]:
    weights = {k: 0.0 for k in KINDS}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in weights:
            raise ValueError(f"unknown request kind {name!r} in --weights (kinds: {', '.join(KINDS)})")
        weights[name] = float(value)
    if not any(v > 0 for v in weights.values()):
        raise ValueError("--weights gives every request kind weight 0")
    return weights


# -- percentiles and the gateway's histogram ----------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of the samples, or None without samples."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarise(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        **{f"p{int(q * 100)}": _ms(percentile(values, q)) for q in (0.5, 0.95, 0.99)},
        "max": _ms(max(values)) if values else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def engine_ttft_buckets(text: str) -> dict[float, float]:
    """The gateway's engine-true TTFT histogram, summed over engines: upper bound -> cumulative count."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == ENGINE_TTFT:
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


def quantile_of(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """PromQL's histogram_quantile over the observations made between two scrapes."""
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    bounds = sorted(delta)
    if not bounds or not math.isinf(bounds[-1]) or delta[bounds[-1]] <= 0:
        return None
    rank, prev_b, prev_c = q * delta[bounds[-1]], 0.0, 0.0
    for b in bounds:
        c = delta[b]
        if c >= rank:
            if math.isinf(b):
                return prev_b
            return b if c == prev_c else prev_b + (b - prev_b) * (rank - prev_c) / (c - prev_c)
        prev_b, prev_c = b, c
    return prev_b


# -- the run's samples (this process) -------------------------------------------------------------------
class Samples:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ttft: dict[str, list[float]] = {k: [] for k in KINDS}
        self.first_audio: list[float] = []
        self.engine_before: dict[float, float] | None = None


SAMPLES = Samples()


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--weights", default="text=4,image=2,audio=2,speech=2", help="request kinds' weights")
    parser.add_argument("--text-model", default="qwen3-omni-flash", help="model of the text requests")
    parser.add_argument("--omni-model", default="qwen3-omni-flash", help="model of image, audio and speech")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--voice", default="Ethan")
    parser.add_argument("--api-key", default="", help="bearer key for the gateway (default: none sent)")
    parser.add_argument("--summary-json", default="", help="write the run's summary here")
    parser.add_argument("--metrics-url", default="", help="the gateway's /metrics (default: HOST/metrics)")


def _metrics_url(env: Environment) -> str:
    opts = env.parsed_options
    if opts is not None and opts.metrics_url:
        return str(opts.metrics_url)
    return (env.host or "").rstrip("/") + "/metrics"


def _scrape(env: Environment) -> dict[float, float] | None:
    import requests

    try:
        r = requests.get(_metrics_url(env), timeout=5)
        return engine_ttft_buckets(r.text) if r.status_code == 200 else None
    except requests.RequestException:
        return None


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    SAMPLES.reset()
    SAMPLES.engine_before = _scrape(environment)


@events.quitting.add_listener
def _quit(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None or not opts.summary_json:
        return
    summary = build_summary(environment)
    Path(opts.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


def build_summary(env: Environment) -> dict[str, Any]:
    stats, opts = env.stats, env.parsed_options
    assert opts is not None
    chat = {k: stats.get(f"chat {k}", "POST") for k in KINDS}
    requests_done = sum(e.num_requests for e in chat.values())
    failures = sum(e.num_failures for e in chat.values())
    first = [e.start_time for e in chat.values() if e.num_requests]
    last = [e.last_request_timestamp for e in chat.values() if e.num_requests and e.last_request_timestamp]
    wall = (max(last) - min(first)) if first and last else 0.0
    duration = max(wall, 1e-9)
    all_ttft = [v for k in KINDS for v in SAMPLES.ttft[k]]
    after = _scrape(env)
    engine_p99 = quantile_of(0.99, SAMPLES.engine_before or {}, after) if after is not None else None
    ttft = summarise(all_ttft)
    audio = summarise(SAMPLES.first_audio)
    rps = requests_done / duration if requests_done else 0.0
    users = env.runner.user_count if env.runner is not None else None
    return {
        "host": env.host,
        "users": getattr(opts, "num_users", None),
        "users_at_end": users,
        "weights": parse_weights(opts.weights),
        "models": {"text": opts.text_model, "omni": opts.omni_model},
        "duration_s": round(wall, 1),
        "requests": requests_done,
        "failures": failures,
        "failures_total": stats.total.num_failures,
        "req_per_s": round(rps, 2),
        "by_kind": {
            k: {
                "requests": e.num_requests,
                "failures": e.num_failures,
                "ttft_ms": summarise(SAMPLES.ttft[k]),
                # Locust's own percentiles of the whole stream (rounded as Locust stores them).
                "stream_ms": {
                    f"p{int(q * 100)}": e.get_response_time_percentile(q) if e.num_requests else None
                    for q in (0.5, 0.95, 0.99)
                },
            }
            for k, e in chat.items()
        },
        "ttft_ms": ttft,
        "first_audio_ms": audio,
        "engine_ttft_p99_ms": _ms(engine_p99),
        "targets": TARGETS,
        "against_targets": {
            "req_per_s": rps >= TARGETS["req_per_s"],
            "ttft_p99_ms": ttft["p99"] is not None and ttft["p99"] < TARGETS["ttft_ms"],
            "engine_ttft_p99_ms": engine_p99 is not None and engine_p99 * 1000 < TARGETS["ttft_ms"],
            "first_audio_p99_ms": audio["p99"] is not None and audio["p99"] < TARGETS["first_audio_p99_ms"],
        },
    }


def whole_stream(resp: Any, sent: float) -> None:
    """The request entry times the whole stream (Locust's own figure would stop at the response headers)."""
    resp.request_meta["response_time"] = (time.perf_counter() - sent) * 1000


# -- the user -------------------------------------------------------------------------------------------
class OmniUser(HttpUser):
    """One client of the deployment: streamed chat completions of the mixed workload, back to back."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        assert opts is not None
        weights = parse_weights(opts.weights)
        self.kinds = [k for k in KINDS if weights[k] > 0]
        self.weights = [weights[k] for k in self.kinds]
        self.opts = opts
        self.headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    def body(self, kind: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.opts.text_model if kind == "text" else self.opts.omni_model,
            "stream": True,
            "messages": messages(kind),
            "max_tokens": self.opts.max_tokens,
        }
        if kind == "speech":
            body["modalities"] = ["text", "audio"]
            body["audio"] = {"voice": self.opts.voice, "format": "wav"}
        return body

    @task
    def chat(self) -> None:
        kind = random.choices(self.kinds, self.weights)[0]
        self.stream(kind)

    def stream(self, kind: str) -> None:
        fire = self.environment.events.request.fire
        sent = time.perf_counter()
        ttft = audio_at = None
        done = False
        with self.client.post(
            "/v1/chat/completions",
            json=self.body(kind),
            headers=self.headers,
            stream=True,
            name=f"chat {kind}",
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                for raw in resp.iter_lines():
                    if not raw.startswith(b"data: "):
                        continue
                    data = raw[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        whole_stream(resp, sent)
                        resp.failure(f"error frame: {chunk['error'].get('message')}")
                        return
                    now = time.perf_counter()
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        audio = delta.get("audio") or {}
                        # With speech asked for, the words come as the audio's transcript (OpenAI's shape).
                        if ttft is None and (delta.get("content") or audio.get("transcript")):
                            ttft = now - sent
                        if audio_at is None and audio.get("data"):
                            audio_at = now - sent
            except Exception as exc:  # a broken stream is the request's failure, with its reason
                whole_stream(resp, sent)
                resp.failure(f"stream broke: {type(exc).__name__}: {exc}")
                return
            whole_stream(resp, sent)
            if not done:
                resp.failure("stream ended without data: [DONE]")
                return
            if ttft is None:
                resp.failure("no text content in the stream")
                return
            if kind == "speech" and audio_at is None:
                resp.failure("speech requested, no audio in the stream")
                return
            resp.success()
        SAMPLES.ttft[kind].append(ttft)
        fire(
            request_type="TTFT",
            name=kind,
            response_time=ttft * 1000,
            response_length=0,
            exception=None,
            context={},
        )
        if audio_at is not None:
            SAMPLES.first_audio.append(audio_at)
            fire(
                request_type="first-audio",
                name=kind,
                response_time=audio_at * 1000,
                response_length=0,
                exception=None,
                context={},
            )
