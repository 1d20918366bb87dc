"""The embedded engine against the real SmolLM2-135M GGUF, offline, on the CPU."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest
import structlog.testing

from core.errors import EngineUnavailable, InvalidRequest
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from engines.adapters.local import LocalEngine, _StopStrings
from engines.adapters.settings import EngineConfig, LocalEngineOptions
from tests import cachedir

pytestmark = pytest.mark.slow

# in the suites' cache outside the clone (tests/cachedir.py), so the GGUF is converted once per machine
CACHE_DIR = cachedir.entry("local-models")
QUESTION = "What is the capital of France? Answer in one sentence."
STORY = "Write a long story about a dragon who learns to bake bread."


def _config(**local: object) -> EngineConfig:
    return EngineConfig(
        name="local",
        kind="local",
        model="SmolLM2-135M-Instruct",
        variant="fp32",
        serves=["local-smollm2"],
        local=LocalEngineOptions(**{"cache_dir": CACHE_DIR, **local}),
    )


def _request(content: str, **kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="local-smollm2", messages=[{"role": "user", "content": content}], **kw)


def _workers() -> list[threading.Thread]:
    # the engine's own generation threads (named after the engine), not another component's that an
    # earlier test in the same process left running
    return [t for t in threading.enumerate() if t.name == "omnigate-local"]


async def _until_no_workers(baseline: int, within_s: float = 2.0) -> float:
    started = time.perf_counter()
    while _workers() or threading.active_count() > baseline:
        assert time.perf_counter() - started < within_s, f"worker still alive: {_workers()}"
        await asyncio.sleep(0.01)
    return time.perf_counter() - started


@pytest.fixture(scope="module")
async def engine():
    eng = LocalEngine(_config())
    await eng.start()
    yield eng
    await eng.aclose()


async def _collect(engine: LocalEngine, request: ChatCompletionRequest) -> list[Delta]:
    return [d async for d in engine.stream(request)]


async def test_health_and_capabilities(engine: LocalEngine) -> None:
    assert await engine.health() is True
    assert engine.capabilities.input_modalities == {"text"}
    assert engine.capabilities.output_modalities == {"text"}


async def test_streams_a_correct_answer_with_exact_usage(engine: LocalEngine) -> None:
    deltas = await _collect(engine, _request(QUESTION, temperature=0))
    pieces = [d.text for d in deltas if d.text]
    text = "".join(pieces)

    assert len(pieces) > 1
    assert text.strip()
    assert re.fullmatch(r"[\x20-\x7e\n]+", text), text
    assert {"the", "is", "of"} & set(re.findall(r"[a-z]+", text.lower())), text
    assert "Paris" in text

    *body, last = deltas
    assert all(d.finish_reason is None and d.usage is None for d in body)
    assert last.finish_reason == "stop"
    assert last.usage is not None
    assert last.usage.prompt_tokens > len(QUESTION.split())
    produced = len(engine._tokenizer(text, add_special_tokens=False)["input_ids"])
    # the end-of-turn token is generated and counted, but carries no text
    assert abs(last.usage.completion_tokens - produced) <= 1


async def test_max_tokens_ends_with_length(engine: LocalEngine) -> None:
    deltas = await _collect(engine, _request(STORY, max_tokens=5))
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 5
    assert "".join(d.text for d in deltas).strip()


async def test_complete_matches_the_stream(engine: LocalEngine) -> None:
    request = _request(QUESTION, max_completion_tokens=40)
    streamed = "".join(d.text for d in await _collect(engine, request))
    done = await engine.complete(request)
    assert isinstance(done, Completion)
    assert done.text == streamed
    assert done.finish_reason == "stop"
    assert done.usage.completion_tokens > 1


async def test_stop_string_cuts_the_text(engine: LocalEngine) -> None:
    deltas = await _collect(engine, _request(QUESTION, stop=["Paris", "\n\n"]))
    text = "".join(d.text for d in deltas)
    assert "Paris" not in text
    assert text.rstrip().endswith("France is"), text
    assert deltas[-1].finish_reason == "stop"


def test_stop_strings_spanning_pieces_are_held_back_and_cut() -> None:
    stops = _StopStrings(["Paris", "\n\n"])
    released = [stops.feed(t) for t in ("The capital is P", "a", "r", "is.")]
    assert released == ["The capital is ", "", "", ""] and stops.hit
    held = _StopStrings(["Paris"])
    assert [held.feed(t) for t in ("Pa", "rty")] == ["", "Party"] and not held.hit
    assert held.feed("at Pa") == "at " and held.flush() == "Pa" and held.flush() == ""
    assert _StopStrings([]).feed("anything") == "anything"


async def test_a_request_that_fails_before_generating_ends_with_its_error(engine: LocalEngine) -> None:
    too_long = "word " * (engine._context_len + 10)
    with pytest.raises(InvalidRequest) as err:
        await asyncio.wait_for(_collect(engine, _request(too_long)), 60)
    assert err.value.code == "context_length_exceeded"
    assert not engine._active
    done = await asyncio.wait_for(engine.complete(_request(QUESTION, max_tokens=3)), 60)
    assert done.usage.completion_tokens == 3


async def test_seed_makes_sampling_reproducible(engine: LocalEngine) -> None:
    async def sample(seed: int) -> str:
        done = await engine.complete(_request(STORY, temperature=1.0, top_p=0.95, seed=seed, max_tokens=12))
        return done.text

    first, again = await sample(1234), await sample(1234)
    assert first == again
    others = {await sample(s) for s in (1, 2)}
    assert len(others | {first}) > 1


async def test_closing_after_the_first_chunk_stops_the_worker(engine: LocalEngine) -> None:
    baseline = threading.active_count()
    gen = engine.stream(_request(STORY, max_tokens=400))
    first = await gen.__anext__()
    assert first.text
    assert _workers(), "generation should run in its own thread"
    await gen.aclose()
    assert await _until_no_workers(baseline) < 2.0
    # the concurrency slot came back: another request runs at once
    done = await asyncio.wait_for(engine.complete(_request(QUESTION, max_tokens=3)), 60)
    assert done.usage.completion_tokens == 3


async def test_cancelling_the_consumer_stops_the_worker(engine: LocalEngine) -> None:
    baseline = threading.active_count()
    got_one = asyncio.Event()

    async def consume() -> None:
        async for d in engine.stream(_request(STORY, max_tokens=400)):
            if d.text:
                got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_no_workers(baseline)


async def test_generation_does_not_block_the_event_loop(engine: LocalEngine) -> None:
    gaps: list[float] = []
    running = True

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    deltas = await _collect(engine, _request(STORY, max_tokens=40))
    running = False
    await tick
    assert len([d for d in deltas if d.text]) > 10
    assert max(gaps) < 0.5, max(gaps)


async def test_second_start_loads_from_the_cache(engine: LocalEngine) -> None:
    assert any(CACHE_DIR.glob("SmolLM2-135M-Instruct*/model.safetensors"))
    other = LocalEngine(_config())
    with structlog.testing.capture_logs() as logs:
        await other.start()
    await other.aclose()
    ready = [e for e in logs if e["event"] == "local_engine_ready"]
    assert ready and ready[0]["source"] == "cache"


def test_cache_key_follows_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    eng = LocalEngine(_config(cache_dir=tmp_path / "cache"))
    before = eng._cache_path(gguf, "x")
    assert before == eng._cache_path(gguf, "x")
    gguf.write_bytes(b"GGUF" + b"\1" * 64)
    assert eng._cache_path(gguf, "x") != before


async def test_stream_before_start_is_unavailable() -> None:
    eng = LocalEngine(_config())
    assert await eng.health() is False
    with pytest.raises(EngineUnavailable):
        await eng.stream(_request(QUESTION)).__anext__()


async def test_a_bad_gguf_is_unavailable(tmp_path: Path) -> None:
    missing = LocalEngine(_config(gguf_file=str(tmp_path / "absent.gguf"), cache_dir=tmp_path))
    with pytest.raises(EngineUnavailable) as missed:
        await missing.start()
    assert "not found" in missed.value.detail  # the detail goes to the log; clients get the generic message

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file" * 100)
    broken = LocalEngine(_config(gguf_file=str(junk), cache_dir=tmp_path))
    with pytest.raises(EngineUnavailable) as info:
        await broken.start()
    assert info.value.__cause__ is not None
    assert await broken.health() is False
