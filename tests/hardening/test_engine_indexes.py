"""An engine's choice indexes are checked against the request's ``n`` before anything is built from them.

An index is the position of a choice among the ``n`` the client asked for: an int (not a bool), at
least 0, below ``n``. Anything else (400000, which made the gateway build a list that long; ``"0"``;
-1; ``n`` itself) is an engine protocol error, raised by the adapter that read it: before the first
byte a failover to the next candidate engine (a 502 ``engine_protocol_error`` when none is left), an
error frame after it, and never a large allocation. The engines here are a raw server that sends
exactly the frames a test gives it (and, for failover, a scripted one behind it).
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from core.errors import EngineProtocolError
from core.schemas import ChatCompletionRequest
from engines.adapters.litellm_engine import LiteLLMEngine
from engines.adapters.openai_compat import OpenAICompatEngine
from engines.adapters.settings import EngineConfig
from engines.adapters.vllm_omni import VLLMOmniEngine
from gateway.settings import Settings
from policies.settings import PolicyChainConfig, PolicySpec
from tests.harness import GatewayServer

pytestmark = pytest.mark.timeout(60)

BAD_INDEXES = [400_000, "0", -1, True, 1.0, None]
"""Each wrong for a request with ``n`` = 1 (``None``: a key present with a null value)."""


class RawEngine:
    """An OpenAI-compatible server that answers every chat request with the frames or body it is given."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.body: dict[str, Any] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> RawEngine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "raw"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(self.body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in self.frames:
            await resp.write(b"data: " + orjson.dumps(frame) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def chunk(index: Any, content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "raw",
        "choices": [
            {"index": index, "delta": {"role": "assistant", "content": content}, "finish_reason": None}
        ],
        **extra,
    }


def answer(*indexes: Any) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "raw",
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            for i in indexes
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def request(n: int | None = None) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=n)


@pytest.fixture
async def raw():
    server = await RawEngine().start()
    yield server
    await server.stop()


def _config(raw: RawEngine, kind: str) -> EngineConfig:
    model = "hosted_vllm/raw" if kind == "litellm" else "raw"
    return EngineConfig(name=f"raw-{kind}", kind=kind, base_url=raw.base_url, model=model, serves=["m"],
                        api_key="sk-test", first_byte_timeout_s=5, read_timeout_s=5)  # fmt: skip


@pytest.fixture(params=["vllm", "vllm-omni", "litellm"])
async def engine(request, raw):
    kind = request.param
    cls = {"vllm": OpenAICompatEngine, "vllm-omni": VLLMOmniEngine, "litellm": LiteLLMEngine}[kind]
    e = cls(_config(raw, kind))
    await e.start()
    yield e
    await e.aclose()


async def _drain(engine: Any, req: ChatCompletionRequest) -> list[Any]:
    out = []
    async with asyncio.timeout(20):
        stream = engine.stream(req)
        try:
            async for d in stream:
                out.append(d)
        finally:
            await stream.aclose()
    return out


@pytest.mark.parametrize("index", BAD_INDEXES, ids=repr)
async def test_a_streamed_choice_index_outside_n_is_a_protocol_error(raw, engine, index):
    if isinstance(engine, LiteLLMEngine) and index is None:
        pytest.skip(
            "litellm's own chunk model fills a missing or null index in with 0 before the adapter sees it"
        )
    raw.frames = [chunk(0, "a"), chunk(index, "b")]
    with pytest.raises(EngineProtocolError):
        await _drain(engine, request())


@pytest.mark.parametrize("n, index", [(2, 2), (2, -1), (2, "1"), (3, 400_000)])
async def test_a_streamed_index_is_judged_against_the_requests_n(raw, index, n):
    e = OpenAICompatEngine(_config(raw, "vllm"))
    await e.start()
    try:
        raw.frames = [chunk(i, "a") for i in range(n)]
        got = await _drain(e, request(n))
        assert sorted({d.index for d in got}) == list(range(n))  # every index below n is taken
        raw.frames = [chunk(0, "a"), chunk(index, "b")]
        with pytest.raises(EngineProtocolError):
            await _drain(e, request(n))
    finally:
        await e.aclose()


@pytest.mark.parametrize("index", BAD_INDEXES, ids=repr)
async def test_a_whole_answers_choice_index_outside_n_is_a_protocol_error(raw, engine, index):
    raw.body = answer(index)
    if isinstance(engine, LiteLLMEngine):
        # litellm numbers a whole answer's choices by their position itself: the engine's index never
        # reaches the adapter, which reads choice 0 only.
        async with asyncio.timeout(20):
            got = await engine.complete(request())
        assert got.text == "hi" and got.alternatives == []
        return
    with pytest.raises(EngineProtocolError):
        async with asyncio.timeout(20):
            await engine.complete(request())


@pytest.mark.parametrize("index", [400_000, "0", -1, 128, True])
async def test_a_streamed_tool_call_index_out_of_range_is_a_protocol_error(raw, index):
    # Tool-call fragments are folded by their index too (core/events.merge_tool_calls).
    e = OpenAICompatEngine(_config(raw, "vllm"))
    await e.start()
    try:
        frame = chunk(0, "")
        frame["choices"][0]["delta"] = {"tool_calls": [{"index": index, "function": {"arguments": "{}"}}]}
        raw.frames = [frame]
        with pytest.raises(EngineProtocolError):
            await _drain(e, request())
    finally:
        await e.aclose()


async def test_no_large_allocation_for_a_huge_index(raw):
    e = OpenAICompatEngine(_config(raw, "vllm"))
    await e.start()
    try:
        raw.frames = [chunk(0, "a"), chunk(400_000, "b")]
        from core.events import Completion

        folded = Completion()
        tracemalloc.start()
        try:
            with pytest.raises(EngineProtocolError):
                async with asyncio.timeout(20):
                    async for d in e.stream(request()):
                        folded.add(d)  # what the relay does with every delta
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert folded.alternatives == []
        assert peak < 4 * 1024 * 1024, peak
    finally:
        await e.aclose()


# -- through a served gateway ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(bg):
    engine = bg.run(RawEngine().start())
    settings = Settings(
        engines=[
            EngineConfig(
                name="raw", kind="vllm", base_url=engine.base_url, model="raw", serves=["m"], read_timeout_s=5
            ),
        ],
        policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
    )
    gateway = GatewayServer(bg, settings).start()
    yield engine, gateway
    gateway.stop()
    bg.run(engine.stop())


def _post(gateway: GatewayServer, stream: bool) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=20)


@pytest.mark.parametrize("index", [400_000, "0", -1, 1], ids=repr)
def test_served_before_the_first_byte_a_bad_index_is_a_clean_engine_error(served, index):
    engine, gateway = served
    engine.frames = [chunk(index, "b")]
    engine.body = answer(index)
    for stream in (True, False):
        resp = _post(gateway, stream)
        assert resp.status_code == 502, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "engine_protocol_error" and err["type"] == "api_error"
        assert "raw" not in err["message"]  # the engine's name stays in the log


@pytest.mark.parametrize("index", [400_000, "0", -1, 1], ids=repr)
def test_served_after_the_first_byte_a_bad_index_is_an_error_frame(served, index):
    engine, gateway = served
    engine.frames = [chunk(0, "a"), chunk(index, "b")]
    resp = _post(gateway, True)
    assert resp.status_code == 200
    frames = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    last = orjson.loads(frames[-2])
    assert last["error"]["code"] == "engine_protocol_error"
    assert all(c["index"] == 0 for f in frames[:-2] for c in orjson.loads(f).get("choices", []))


# -- a bad index before the first byte fails over -------------------------------------------------------
@pytest.fixture
def served_pair(bg):
    """Two engines for one model: a raw one first (it sends what a test gives it), a scripted one after.

    One gateway per test: the raw engine's failures count against its circuit, which a later test would
    find open."""
    from tests.upstream import Script, ScriptedUpstream

    raw = bg.run(RawEngine().start())
    good = ScriptedUpstream(Script(flavour="vllm", text="from the second engine"))
    bg.run(good.start())
    settings = Settings(
        engines=[
            EngineConfig(
                name="raw", kind="vllm", base_url=raw.base_url, model="raw", serves=["m"], read_timeout_s=5
            ),
            EngineConfig(
                name="scripted", kind="vllm", base_url=good.base_url, model="scripted", role="fallback",
                serves=["m"], read_timeout_s=5,
            ),
        ],
        policies=PolicyChainConfig(pre=[PolicySpec(name="request-limits")]),
        logging={"level": "warning"},
        routing={"controller": {"enabled": False}},
    )  # fmt: skip
    gateway = GatewayServer(bg, settings).start()
    yield raw, good, gateway
    gateway.stop()
    bg.run(good.stop())
    bg.run(raw.stop())


@pytest.mark.parametrize("index", [400_000, "0", -1, 1], ids=repr)
def test_served_before_the_first_byte_a_bad_index_fails_over_to_the_next_engine(served_pair, index):
    # An unreadable answer is the engine's failure like a 5xx: nothing has reached the client yet, so the
    # request goes to the next candidate (STYLE rule 11) instead of ending in a 502.
    raw, good, gateway = served_pair
    raw.frames = [chunk(index, "b")]
    raw.body = answer(index)
    for stream in (True, False):
        before = good.request_count
        resp = _post(gateway, stream)
        assert resp.status_code == 200, resp.text
        assert good.request_count == before + 1
        if stream:
            frames = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert frames[-1] == "[DONE]"
            chunks = [orjson.loads(f) for f in frames[:-1]]
            assert all("error" not in c for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        else:
            text = resp.json()["choices"][0]["message"]["content"]
        assert "second engine" in text


def test_served_after_the_first_byte_a_bad_index_stays_an_error_frame_with_another_engine(served_pair):
    raw, good, gateway = served_pair
    raw.frames = [chunk(0, "a"), chunk(400_000, "b")]
    before = good.request_count
    resp = _post(gateway, True)
    assert resp.status_code == 200
    frames = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert orjson.loads(frames[-2])["error"]["code"] == "engine_protocol_error"
    assert good.request_count == before  # the answer had begun: no second engine
