"""Issue 15's memory target, through the front door: what a large audio part costs the gateway.

Two measures:

- the peak: a real ``omnigate serve`` process's peak resident set size over one request
  (``VmHWM``, reset through ``/proc/PID/clear_refs`` after a warm-up request), the issue's own
  measure, in a process that does nothing else. Decoding is in the sandbox's worker processes, so
  this is what the gateway holds: the body, the parsed request, the part's bytes in the segment it
  shares with the workers, the output, the engine's body;
- what is still allocated while the engine has the request: a gateway in this process
  (``tracemalloc`` sees all its allocations, whatever holds them), the scripted engine in a process
  of its own made to wait before it answers, a client writing raw bytes on a socket; and the
  reference count of the client's string.

Target (issue 15): peak memory per request at most 3x the decoded output it forwards, never more
than the per-request budget; once the media step has replaced a part, nothing holds the client's
base64 any more. A payload of 1 MiB or more is decoded into the spool (core/spooled.py) as the
body arrives: its bytes are then in a shared-memory file (counted by the media budgets), not in the
gateway's resident set.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from bench.common import free_port
from core import spooled
from engines.adapters.settings import EngineConfig
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer
from tests.media import data_uri, tone, wav

pytestmark = pytest.mark.timeout(240)
MODEL = "omni"
ENGINE_WAIT_S = 1.5


@pytest.fixture(scope="module")
def engine():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.upstream",
            "--port",
            str(port),
            "--flavour",
            "omni",
            "--first-byte-delay-ms",
            str(int(ENGINE_WAIT_S * 1000)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the scripted engine did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def gw(bg, engine, tmp_path_factory):
    db = tmp_path_factory.mktemp("audit") / "audit.db"
    settings = Settings(
        engines=[
            EngineConfig(
                name="omni",
                kind="vllm-omni",
                base_url=engine + "/v1",
                model="scripted",
                serves=[MODEL],
                input_modalities=["text", "image", "audio", "video"],
                first_byte_timeout_s=30,
                read_timeout_s=30,
            )
        ],
        policies=PolicyChainConfig(
            pre=[
                PolicySpec(name="request-limits"),
                PolicySpec(name="media-fetch"),
                PolicySpec(name="media-limits"),
            ]
        ),
        audit={"sqlite_path": str(db)},  # the audit record is one of the things that could keep the input
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    server.db = str(db)
    _send(server, _body(data_uri("audio/wav", wav(tone(2.0), 16000))))  # load the decoders and workers
    yield server
    server.stop()


def _body(uri: str) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is said?"},
                        {"type": "audio_url", "audio_url": {"url": uri}},
                    ],
                }
            ],
        }
    )


def _send(server: GatewayServer, body: bytes, request_id: str = "m") -> int:
    """POST ``body`` on a raw socket (nothing copied on this side); the response's status."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"x-request-id: %s\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
            % (request_id.encode(), len(body))
        )
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def _engine_stats(engine: str) -> dict:
    return httpx.get(engine + "/_stats", timeout=5).json()


def _status_kib(key: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _held(server: GatewayServer, engine: str, body: bytes) -> dict:
    """What is allocated (traced) while the engine has the request, and what the engine was sent."""
    status: list[int] = []
    httpx.post(engine + "/_reset", timeout=5)
    client = threading.Thread(target=lambda: status.append(_send(server, body)))
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        client.start()
        held = None
        while client.is_alive():
            if held is None and _engine_stats(engine)["last_body_bytes"]:
                # The engine has read the whole body and waits ENGINE_WAIT_S before it answers.
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - base
            time.sleep(0.02)
        client.join()
    finally:
        tracemalloc.stop()
    assert status == [200]
    assert held is not None, "the engine call was never seen in flight"
    return {"held": held, "forwarded": _engine_stats(engine)["last_body_bytes"]}


@pytest.fixture
def served():
    """A real ``omnigate serve`` (default chain) and the scripted engine, each a process of its own; a
    fresh pair per test, so that no request's peak depends on what an earlier one left in the heap."""
    from bench.hostile_media import Rig

    rig = Rig.start()
    rig.engine = "http://127.0.0.1:" + rig.upstream.args[rig.upstream.args.index("--port") + 1]
    small = _body(data_uri("audio/wav", wav(tone(2.0), 16000)))
    assert (
        httpx.post(
            rig.url + "/v1/chat/completions",
            content=small,
            timeout=120,
            headers={"content-type": "application/json"},
        ).status_code
        == 200
    )  # warm the path
    yield rig
    rig.stop()


def _peak(rig, body: bytes) -> dict:
    """The served gateway's peak RSS growth over one request, and what the engine was sent.

    The same request is sent once before the one measured: a first use's costs (an allocator's first
    arena for that size, a module's first import) are not what every request holds."""
    pid = rig.gateway.pid
    assert (
        httpx.post(
            rig.url + "/v1/chat/completions",
            content=body,
            timeout=120,
            headers={"content-type": "application/json"},
        ).status_code
        == 200
    )
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    rss = _status_kib("VmRSS", pid) * 1024
    resp = httpx.post(
        rig.url + "/v1/chat/completions",
        content=body,
        timeout=120,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 200, resp.text
    peak = _status_kib("VmHWM", pid) * 1024 - rss
    left = [f for f in os.listdir(spooled.SHM_DIR) if f.startswith(f"omnigate-{pid}-")]
    assert not left, left  # the spooled payloads went with the request
    return {"peak": peak, "forwarded": _engine_stats(rig.engine)["last_body_bytes"]}


def test_audio_forwarded_unchanged_peaks_under_3x_what_it_forwards(served):
    uri = data_uri("audio/wav", wav(tone(300.0), 16000))  # 5 min at the engine's rate: forwarded as sent
    body = _body(uri)
    m = _peak(served, body)
    assert m["forwarded"] > len(uri)  # the client's data URI, in the engine's body
    # The payload is spooled as it arrives and re-encoded into the engine's body a piece at a time:
    # about 0.4x measured (2x when the body was parsed whole, 3.0x before the bodies were streamed).
    assert m["peak"] <= 3 * m["forwarded"], m
    assert m["peak"] <= len(body), m  # never the client's string whole
    assert m["peak"] <= 256 * 2**20  # media.max_request_bytes


def test_a_shrunk_part_peaks_under_3x_what_it_forwards(served):
    uri = data_uri("audio/wav", wav(tone(120.0, rate=44100), 44100))  # 2 min at 44.1 kHz: sent as 16 kHz WAV
    body = _body(uri)
    m = _peak(served, body)
    assert m["forwarded"] < len(uri) / 2.5  # the engine gets much less than the client sent (16 of 44.1 kHz)
    # Neither the body's payload nor the output sits in the gateway's heap: the payload is decoded into
    # the spool as it arrives, the worker writes the output into a file reserved for it from the probed
    # duration, and the engine's body is re-encoded from that file a piece at a time. 0.3x measured;
    # 2.0x the *input* (21x the output) when the body was read whole, 3.0x the input before that.
    assert m["peak"] <= 3 * m["forwarded"], m


def test_audio_forwarded_unchanged_is_held_once_while_the_engine_works(gw, engine):
    uri = data_uri("audio/wav", wav(tone(300.0), 16000))
    m = _held(gw, engine, _body(uri))
    # The forwarded part once (the client's own string, reused), not a serialised body beside it.
    assert m["held"] <= 1.25 * m["forwarded"], m


def test_a_resampled_part_releases_the_clients_base64_before_the_engine_call(gw, engine):
    uri = data_uri("audio/wav", wav(tone(120.0, rate=44100), 44100))
    m = _held(gw, engine, _body(uri))
    assert m["forwarded"] < len(uri) / 2.5
    # What is left while the engine works follows the output: the client's 14 MB string is gone.
    assert m["held"] <= 3 * m["forwarded"], m


@pytest.mark.parametrize("audit_content", ["digests", "raw"])
def test_once_the_engine_has_the_request_only_the_caller_holds_the_clients_string(gw, engine, audit_content):
    """The string the parsed request carries, by reference count: the pipeline (its frames, the request
    context, the audit's copy of the request, the media step's leftovers) keeps no reference to it.
    ``audit_content: raw`` records the request as sent, media included: there the context keeps it."""
    from core.context import RequestContext
    from core.schemas import ChatCompletionRequest

    pcm = wav(tone(30.0, rate=44100), 44100)  # resampled: the part is replaced, not reused
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is said?"},
                        {"type": "input_audio", "input_audio": {"data": wav_b64(pcm)}},
                    ],
                }
            ],
        }
    )
    client_string = request.messages[0].content[1].input_audio.data
    ctx = RequestContext.new("refcount", audit_content=audit_content)
    httpx.post(engine + "/_reset", timeout=5)
    running = asyncio.run_coroutine_threadsafe(gw.services.pipeline.complete(request, ctx), gw.bg.loop)
    del request
    deadline = time.monotonic() + 60
    while not _engine_stats(engine)["last_body_bytes"]:
        assert not running.done(), running.result()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    holders = sys.getrefcount(client_string) - 2  # minus this frame's name and getrefcount's argument
    running.result(60)
    assert holders == (1 if audit_content == "raw" else 0)
    if audit_content != "raw":
        digest = ctx.record.input_digests.get()
        assert digest[1]["sha256"] == hashlib.sha256(client_string.encode()).hexdigest()
        assert digest[1]["chars"] == len(client_string)


def wav_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("case", ["served", "refused by the media step"])
def test_the_audit_record_still_digests_the_clients_media(gw, case):
    """The digests are made before the pipeline lets go of the client's strings: the record (in the real
    store) names each part with the SHA-256 of what the client sent, served or refused."""
    import sqlite3

    if case == "served":
        uri = data_uri("audio/wav", wav(tone(20.0, rate=44100), 44100))
    else:  # a WAV header over garbage: refused by media-limits after the digests were started
        uri = data_uri("audio/wav", b"RIFF\0\0\0\0WAVEjunk" * 200_000)
    rid = "digest-" + case.split()[0]
    status = _send(gw, _body(uri), request_id=rid)
    assert status == (200 if case == "served" else 400)
    deadline = time.monotonic() + 10
    while True:
        db = sqlite3.connect(gw.db)
        try:
            row = db.execute(
                "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?",
                (rid,),
            ).fetchone()
        finally:
            db.close()
        if row is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert row is not None
    inputs = orjson.loads(row[0])["payload"]["input"]
    assert inputs == [
        {"role": "user", "type": "text", "sha256": hashlib.sha256(b"what is said?").hexdigest(), "chars": 13},
        {
            "role": "user",
            "type": "audio_url",
            "sha256": hashlib.sha256(uri.encode()).hexdigest(),
            "chars": len(uri),
        },
    ]


def _tree_kib(pid: int) -> int:
    """Resident set size of ``pid`` and every process below it (the decoding workers), KiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += _status_kib("VmRSS", p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue  # a worker that ended meanwhile
    return total


@pytest.fixture
def served_48k(monkeypatch):
    """A served gateway (default chain) whose engine takes audio at 48 kHz (the media step's
    ``max_output_rate``, what an engine that declares no rate gets)."""
    from bench import hostile_media

    plain = hostile_media.gateway_config

    def config(port: int) -> dict:
        cfg = plain(port)
        cfg["engines"][0]["audio_input_rate"] = 48000
        # an engine that takes FLAC (the measure is of a few MB of FLAC out, not the 236 MB of 48 kHz WAV)
        cfg["policies"] = {"pre": [
            {"name": "load-shedding"}, {"name": "request-limits"}, {"name": "media-fetch"},
            {"name": "media-limits", "config": {"audio": {"encoding": "flac"}}}, {"name": "nsfw-screen"},
        ]}  # fmt: skip
        # a slow, shared machine must not turn the measure into a decode timeout
        cfg["media"] = {"decode_deadline_s": 300, "decode_cpu_s": 300}
        return cfg

    monkeypatch.setattr(hostile_media, "gateway_config", config)
    rig = hostile_media.Rig.start()
    small = _body(data_uri("audio/wav", wav(tone(2.0), 16000)))
    warm = httpx.post(
        rig.url + "/v1/chat/completions",
        content=small,
        timeout=120,
        headers={"content-type": "application/json"},
    )
    assert warm.status_code == 200, warm.text
    yield rig
    rig.stop()


def test_a_long_high_rate_flac_costs_the_process_tree_what_it_sends_not_what_it_declares(served_48k):
    """Issue 26: 41 minutes declared at 96 kHz in a small FLAC, served in two segments. The output the
    engine gets is a few MB of FLAC; the source's rate and length must not size anything, nor the PCM of
    the whole part at the output rate (236 MB at 48 kHz). The whole tree is watched (gateway and decoding
    workers), sampled while the request runs."""
    from tests.media import hostile_flac

    body = _body(data_uri("audio/flac", hostile_flac(2460.0, 96000)))
    served = served_48k
    pid = served.gateway.pid
    base = _tree_kib(pid)
    peak = base
    result: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: result.append(
            httpx.post(
                served.url + "/v1/chat/completions",
                content=body,
                timeout=180,
                headers={"content-type": "application/json"},
            )
        )
    )
    client.start()
    while client.is_alive():
        peak = max(peak, _tree_kib(pid))
        time.sleep(0.01)
    client.join()
    assert result and result[0].status_code == 200, result[0].text if result else None
    growth = (peak - base) * 1024
    # 687 MiB when the part's whole PCM at the output rate was decoded into one buffer and handed back
    # from the worker to be cut into segments; about 12 MiB when each segment is encoded as it decodes.
    assert growth < 300 * 2**20, f"the process tree grew by {growth / 2**20:.0f} MiB"
