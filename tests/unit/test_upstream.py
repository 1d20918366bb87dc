"""Tests of the scripted upstream itself: the double must be right before other tests can lean on it."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from tests.upstream import Script, ScriptedUpstream

ROOT = Path(__file__).resolve().parents[2]
TEXT = Script().text
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def up():
    async with ScriptedUpstream() as server:
        yield server


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def chat_body(**extra):
    return {"model": "qwen3-omni", "messages": [{"role": "user", "content": "hi"}], **extra}


async def post(session, up, **extra) -> aiohttp.ClientResponse:
    return await session.post(f"{up.base_url}/chat/completions", json=chat_body(**extra))


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    """The payloads of the `data:` lines, in order."""
    out = []
    async for line in resp.content:
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data: "):
            out.append(line[6:].decode())
        else:
            assert line == b"", line
    return out


async def status_of(request) -> int:
    """Await a request, read its body (so the connection goes back to the pool) and return the status."""
    async with await request as resp:
        await resp.read()
        return resp.status


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    data, sr = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="int16")
    return data, sr


# --- vllm flavour ------------------------------------------------------------------------------------------


async def test_vllm_stream_shape_and_usage(up, session):
    resp = await post(session, up, stream=True, stream_options={"include_usage": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    payloads = await read_sse(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *content, usage_chunk = chunks

    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == "qwen3-omni"
        assert isinstance(c["created"], int)
        assert "modality" not in c
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for c in content:
        assert len(c["choices"]) == 1 and c["choices"][0]["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["stop"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == TEXT
    pieces = len(content) - 1
    assert pieces == len(TEXT.split())

    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage == {"prompt_tokens": 11, "completion_tokens": pieces, "total_tokens": 11 + pieces}
    assert up.completed == 1 and up.aborts == 0 and up.in_flight == 0
    assert up.requests[0]["model"] == "qwen3-omni"


async def test_vllm_stream_without_usage_and_chunk_words(up, session):
    up.default = Script(text="one two three four five six seven", chunk_words=3)
    payloads = await read_sse(await post(session, up, stream=True))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["choices"] for c in chunks)  # no usage chunk unless asked
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert pieces == ["one two three ", "four five six ", "seven"]

    odd = "  leading,  double  spaces\nand a newline "
    up.default = Script(text=odd, chunk_words=2)
    payloads = await read_sse(await post(session, up, stream=True))
    assert "".join(json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]) == odd


async def test_vllm_max_tokens_stops_early_with_length(up, session):
    payloads = await read_sse(
        await post(session, up, stream=True, max_tokens=3, stream_options={"include_usage": True})
    )
    chunks = [json.loads(p) for p in payloads[:-1]]
    content = chunks[1:-1]
    assert len(content) == 3
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == "Hello from the "
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_vllm_non_streaming(up, session):
    resp = await post(session, up, max_tokens=2)
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "qwen3-omni"
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Hello from "
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}


# --- omni flavour ------------------------------------------------------------------------------------------


async def test_omni_stream_with_audio(up, session):
    """vLLM-Omni 0.30.0's stream: text first, then audio pieces that are complete WAV files; the last audio
    chunk carries the stop, the last text chunk none; audio chunks count 0 tokens; vLLM's extras everywhere."""
    up.default = Script(flavour="omni", text="Short reply here.", audio_chunks=4)
    resp = await post(
        session, up, stream=True, modalities=["text", "audio"], voice="Chelsie",
        stream_options={"include_usage": True},
    )  # fmt: skip
    payloads = await read_sse(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *stream, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and "modality" not in usage_chunk
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert all(c["modality"] in ("text", "audio") for c in stream)

    mods = [c["modality"] for c in stream]
    n_audio = mods.count("audio")
    assert n_audio == 4
    assert mods == ["text"] * (len(mods) - n_audio) + ["audio"] * n_audio  # text first, then audio

    text_chunks = [c for c in stream if c["modality"] == "text"]
    audio_chunks = [c for c in stream if c["modality"] == "audio"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in text_chunks) == "Short reply here."
    for c in text_chunks:
        assert "audio_metadata" not in c["choices"][0]
        assert not c["choices"][0]["delta"]["content"].startswith("UklGR")  # base64 of "RIFF"
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * len(text_chunks)
    assert [c["choices"][0]["finish_reason"] for c in audio_chunks] == [None] * 3 + ["stop"]
    for c in stream:
        assert {"metrics", "prompt_token_ids"} <= set(c) and {"token_ids", "stop_reason"} <= set(
            c["choices"][0]
        )

    signals = []
    for c in audio_chunks:
        choice = c["choices"][0]
        assert "audio" not in choice["delta"] and choice["delta"]["role"] == "assistant"
        assert c["usage"]["completion_tokens"] == 0
        pcm, sr = decode_wav(choice["delta"]["content"])  # each piece a WAV file of its own
        meta = choice["audio_metadata"]
        assert meta == {"format": "wav", "sample_rate_hz": 24000, "frame_count": len(pcm), "channels": 1}
        assert sr == 24000 and pcm.ndim == 1
        assert len(pcm) == round(0.2 * 24000)
        assert np.abs(pcm).max() > 1000  # audible, not silence
        signals.append(pcm)
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(signals))
    assert up.voices == ["Chelsie"]


async def test_omni_build_variants_header_first_no_metadata_bare_finish(up, session):
    up.default = Script(flavour="omni", text="Hi.", audio_chunks=3, omni_wav_headers="first",
                        omni_audio_metadata=False, omni_bare_finish=True)  # fmt: skip
    chunks = [json.loads(p) for p in (await read_sse(await post(
        session, up, stream=True, modalities=["text", "audio"])))[:-1]]  # fmt: skip
    audio = [c for c in chunks if c.get("modality") == "audio"]
    raw = [base64.b64decode(c["choices"][0]["delta"]["content"]) for c in audio]
    assert raw[0][:4] == b"RIFF" and all(r[:4] != b"RIFF" for r in raw[1:])
    assert all("audio_metadata" not in c["choices"][0] for c in audio)
    assert all(c["choices"][0]["finish_reason"] is None for c in audio)
    bare = chunks[-1]
    assert "modality" not in bare and bare["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


async def test_omni_asked_for_pcm_sends_bare_pcm(up, session):
    up.default = Script(flavour="omni", text="Hi.", audio_chunks=2, sample_rate=16000)
    chunks = [json.loads(p) for p in (await read_sse(await post(
        session, up, stream=True, modalities=["text", "audio"], audio={"format": "pcm"})))[:-1]]  # fmt: skip
    audio = [c["choices"][0] for c in chunks if c.get("modality") == "audio"]
    assert all(base64.b64decode(a["delta"]["content"])[:4] != b"RIFF" for a in audio)
    assert (
        audio[0]["audio_metadata"]["format"] == "pcm"
        and audio[0]["audio_metadata"]["sample_rate_hz"] == 16000
    )


async def test_omni_voice_from_speaker_and_default_audio_length(up, session):
    up.default = Script(flavour="omni", transcript="x" * 50)  # 50 chars * 0.06 s = 3.0 s = 15 chunks of 0.2 s
    payloads = await read_sse(await post(session, up, stream=True, modalities=["audio"], speaker="Ethan"))
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert sum(c.get("modality") == "audio" for c in chunks) == 15
    assert up.voices == ["Ethan"]


async def test_omni_unknown_speaker_is_a_json_400_even_for_a_stream(up, session):
    up.default = Script(flavour="omni")
    resp = await post(session, up, stream=True, modalities=["text", "audio"], voice="Cherry")
    assert resp.status == 400 and resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert err == {
        "message": "Invalid speaker 'Cherry'. Supported: aiden, chelsie, ethan",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert up.completed == 0


async def test_omni_text_only_has_no_audio(up, session):
    up.default = Script(flavour="omni")
    payloads = await read_sse(await post(session, up, stream=True, modalities=["text"]))
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["modality"] for c in chunks} == {"text"}
    assert all("audio_metadata" not in c["choices"][0] for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # text only: the text's own stop

    body = await (await post(session, up, modalities=["text"])).json()
    assert len(body["choices"]) == 1 and "audio" not in body["choices"][0]["message"]


async def test_omni_non_streaming_merged_choice(up, session):
    up.default = Script(flavour="omni", text="One choice.", audio_chunks=3, audio_seconds_per_chunk=0.1)
    body = await (await post(session, up, modalities=["text", "audio"])).json()
    assert "modality" not in body
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["message"]["content"] == "One choice."
    a = choice["message"]["audio"]
    assert set(a) == {"id", "data", "expires_at", "transcript"} and a["transcript"] == ""
    pcm, sr = decode_wav(a["data"])
    assert sr == 24000 and len(pcm) == 3 * 2400
    assert choice["audio_metadata"]["sample_rate_hz"] == 24000


@pytest.mark.parametrize("shape", ["split", "split_audio_first"])
async def test_omni_non_streaming_two_choices_both_index_0(up, session, shape):
    up.default = Script(flavour="omni", text="Two choices.", audio_chunks=3, audio_seconds_per_chunk=0.1,
                        omni_choices=shape)  # fmt: skip
    body = await (await post(session, up, modalities=["text", "audio"])).json()
    assert len(body["choices"]) == 2 and [c["index"] for c in body["choices"]] == [0, 0]
    audio_first = shape == "split_audio_first"
    text, audio = body["choices"][::-1] if audio_first else body["choices"]
    assert text["message"]["content"] == "Two choices." and "audio" not in text["message"]
    assert audio["message"]["content"] is None
    pcm, sr = decode_wav(audio["message"]["audio"]["data"])
    assert sr == 24000 and len(pcm) == 3 * 2400


async def test_omni_health_and_stage_metrics(up, session):
    up.health_status = 503
    async with session.get(up.base_url.removesuffix("/v1") + "/health") as resp:
        assert resp.status == 503
    async with session.get(up.base_url + "/models") as resp:
        assert resp.status == 200  # what a dead vLLM-Omni still answers
    up.stage_metrics = {"0": {"running": 2, "ttft": [0.07, 0.3]}, "1": {"running": 2}}
    async with session.get(up.base_url.removesuffix("/v1") + "/metrics") as resp:
        text = await resp.text()
    assert 'vllm:num_requests_running{model_name="scripted",stage="0",replica="0"} 2.0' in text
    assert 'vllm:num_requests_running{model_name="scripted",stage="1",replica="0"} 2.0' in text
    assert (
        'vllm:time_to_first_token_seconds_bucket{model_name="scripted",stage="0",replica="0",le="0.1"} 1.0'
        in text
    )
    assert "vllm_omni:num_requests_running" in text


# --- faults ------------------------------------------------------------------------------------------------


async def test_500_before_headers(up, session):
    up.enqueue(Script(fault="500_before_headers"), Script(fault="500_before_headers", status_body={"x": 1}))
    resp = await post(session, up, stream=True)
    assert resp.status == 500
    err = (await resp.json())["error"]
    assert err["code"] == 500 and err["message"]
    resp = await post(session, up, stream=True)
    assert resp.status == 500 and await resp.json() == {"x": 1}
    assert up.errors == 2 and up.aborts == 0


async def test_503_retry_after(up, session):
    up.enqueue(Script(fault="503_retry_after"))
    resp = await post(session, up, stream=True)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "2"
    assert (await resp.json())["error"]["code"] == 503


async def test_reset_before_first_byte(up, session):
    up.enqueue(Script(fault="reset_before_first_byte"))
    with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        await post(session, up, stream=True)
    assert up.resets == 1 and up.aborts == 0
    # the next request (new connection) is served normally
    assert await status_of(post(session, up)) == 200


@pytest.mark.parametrize("after", [0, 3])
async def test_reset_mid_stream(up, session, after):
    up.enqueue(Script(fault="reset_mid_stream", fault_after_chunks=after))
    resp = await post(session, up, stream=True)
    assert resp.status == 200
    got = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async for line in resp.content:
            if line.startswith(b"data: "):
                got.append(line)
    resp.close()
    assert len(got) == after
    assert up.resets == 1 and up.aborts == 0 and up.completed == 0
    await asyncio.sleep(0.05)
    assert up.in_flight == 0


async def test_hang_before_first_byte_then_client_gives_up(up, session):
    up.enqueue(Script(fault="hang_before_first_byte"))
    with pytest.raises(asyncio.TimeoutError):
        await session.post(
            f"{up.base_url}/chat/completions",
            json=chat_body(stream=True),
            timeout=aiohttp.ClientTimeout(total=0.3),
        )
    await asyncio.wait_for(up.abort_event.wait(), 0.3)
    assert up.aborts == 1 and up.completed == 0


async def test_hang_mid_stream(up, session):
    up.enqueue(Script(fault="hang_mid_stream", fault_after_chunks=2))
    resp = await post(session, up, stream=True)
    lines = [await asyncio.wait_for(resp.content.readline(), 1) for _ in range(4)]
    assert [ln.startswith(b"data: ") for ln in lines] == [True, False, True, False]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(resp.content.readline(), 0.3)
    assert not up.abort_event.is_set()
    resp.close()
    await asyncio.wait_for(up.abort_event.wait(), 0.3)
    assert up.aborts == 1


async def test_malformed_json(up, session):
    up.enqueue(Script(fault="malformed_json", fault_after_chunks=2))
    payloads = await read_sse(await post(session, up, stream=True))
    assert payloads[2] == "{not json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(payloads[2])
    json.loads(payloads[1])
    json.loads(payloads[3])
    assert payloads[-1] == "[DONE]"


async def test_drip_one_chunk_per_second(up, session):
    up.enqueue(Script(fault="drip"))
    resp = await post(session, up, stream=True)
    stamps = []
    while len(stamps) < 3:
        line = await asyncio.wait_for(resp.content.readline(), 2)
        if line.startswith(b"data: "):
            stamps.append(time.monotonic())
    gaps = np.diff(stamps)
    assert all(0.9 < g < 1.3 for g in gaps), gaps
    resp.close()


async def test_first_byte_and_chunk_delays(up, session):
    up.enqueue(Script(text="a b c d", first_byte_delay_s=0.2, chunk_delay_s=0.05))
    t0 = time.monotonic()
    resp = await post(session, up, stream=True)
    t_headers = time.monotonic() - t0
    await read_sse(resp)
    t_total = time.monotonic() - t0
    assert 0.18 < t_headers < 0.5
    assert t_total >= 0.2 + 4 * 0.05  # four gaps between five frames, plus one before [DONE]


async def test_abort_detected_while_sleeping_between_chunks(up, session):
    up.default = Script(chunk_delay_s=0.5)
    resp = await post(session, up, stream=True)
    assert (await resp.content.readline()).startswith(b"data: ")
    assert up.in_flight == 1
    t0 = time.monotonic()
    resp.close()
    await asyncio.wait_for(up.abort_event.wait(), 0.3)
    assert time.monotonic() - t0 < 0.3
    assert up.aborts == 1 and up.completed == 0
    await asyncio.sleep(0.02)
    assert up.in_flight == 0


async def test_complete_stream_is_not_an_abort(up, session):
    for _ in range(3):
        await read_sse(await post(session, up, stream=True))
    await asyncio.sleep(0.05)
    assert up.completed == 3 and up.aborts == 0 and not up.abort_event.is_set()


async def test_stop_with_hanging_request_is_quick_and_not_an_abort(session):
    server = await ScriptedUpstream(Script(fault="hang_before_first_byte")).start()
    task = asyncio.create_task(post(session, server, stream=True))
    while server.in_flight == 0:  # noqa: ASYNC110 - the upstream counts requests; it signals none arriving
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await server.stop()
    assert time.monotonic() - t0 < 2.0
    assert server.aborts == 0
    with pytest.raises(aiohttp.ClientError):
        await task


# --- bookkeeping and other endpoints -----------------------------------------------------------------------


async def test_queue_then_default_and_recording(up, session):
    up.enqueue(Script(text="first"), Script(text="second"))
    texts = []
    for _ in range(3):
        resp = await session.post(
            f"{up.base_url}/chat/completions", json=chat_body(), headers={"Authorization": "Bearer k"}
        )
        texts.append((await resp.json())["choices"][0]["message"]["content"])
    assert texts == ["first", "second", TEXT]
    assert len(up.requests) == 3 and up.requests[0]["messages"][0]["content"] == "hi"
    assert up.headers[0]["authorization"] == "Bearer k"


async def test_many_concurrent_streams(up):
    up.default = Script(chunk_delay_s=0.01)
    n = 64

    url = f"{up.base_url}/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as conn_session:
        starts = [conn_session.post(url, json=chat_body(stream=True)) for _ in range(n)]
        results = await asyncio.gather(*starts)
        bodies = await asyncio.gather(*(read_sse(r) for r in results))
    assert all(b[-1] == "[DONE]" for b in bodies)
    assert up.completed == n and up.max_in_flight == n and up.in_flight == 0


async def test_models_health_metrics(session):
    async with ScriptedUpstream(models=["a", "b"]) as server:
        root = server.base_url.removesuffix("/v1")
        models = await (await session.get(f"{server.base_url}/models")).json()
        assert [m["id"] for m in models["data"]] == ["a", "b"] and models["object"] == "list"
        assert await status_of(session.get(f"{root}/health")) == 200

        server.num_requests_waiting = 7
        server.kv_cache_usage_perc = 0.42
        text = await (await session.get(f"{root}/metrics")).text()
        assert 'vllm:num_requests_running{model_name="a"} 0.0' in text
        assert 'vllm:num_requests_waiting{model_name="a"} 7.0' in text
        assert 'vllm:kv_cache_usage_perc{model_name="a"} 0.42' in text
        assert "# TYPE vllm:kv_cache_usage_perc gauge" in text


async def test_control_endpoints(up, session):
    root = up.base_url.removesuffix("/v1")
    steer = {"flavour": "omni", "text": "Steered.", "chunk_delay_s": 0}
    assert await status_of(session.post(f"{root}/_script", json=steer)) == 200
    assert up.default.flavour == "omni" and up.default.text == "Steered."
    assert await status_of(session.post(f"{root}/_script", json={"nope": 1})) == 400
    assert await status_of(session.post(f"{root}/_script", json={"fault": "bogus"})) == 400

    assert await status_of(session.post(f"{root}/_enqueue", json=[{"fault": "503_retry_after"}])) == 200
    assert await status_of(post(session, up)) == 503
    body = await (await post(session, up)).json()
    assert body["choices"][0]["message"]["content"] == "Steered."

    assert await status_of(session.post(f"{root}/_metrics", json={"num_requests_running": 3})) == 200
    metrics = await (await session.get(f"{root}/metrics")).text()
    assert 'vllm:num_requests_running{model_name="scripted"} 3.0' in metrics

    stats = await (await session.get(f"{root}/_stats")).json()
    assert stats["requests"] == 2 and stats["completed"] == 1 and stats["errors"] == 1
    assert stats["aborts"] == 0 and stats["in_flight"] == 0
    stats = await (await session.post(f"{root}/_reset")).json()
    assert stats["requests"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_cli_standalone(session):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream", "--port", str(port), "--flavour", "omni", "--chunks", "5",
         "--audio-chunks", "2", "--chunk-delay-ms", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if await status_of(session.get(f"{base}/health")) == 200:
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        payloads = await read_sse(
            await session.post(
                f"{base}/v1/chat/completions", json=chat_body(stream=True, modalities=["text", "audio"])
            )
        )
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert sum(c["modality"] == "text" for c in chunks) == 1 + 5
        assert sum(c["modality"] == "audio" for c in chunks) == 2
        stats = await (await session.get(f"{base}/_stats")).json()
        assert stats["completed"] == 1
    finally:
        proc.terminate()
        proc.communicate(timeout=5)  # also closes the pipe


def test_script_defaults():
    s = Script()
    assert s.flavour == "vllm" and s.fault is None and s.sample_rate == 24000
    assert s.n_audio_chunks == math.ceil(len(TEXT) * 0.06 / 0.2)
    with pytest.raises(ValueError):
        Script(flavour="tgi")
