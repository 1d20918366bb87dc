"""The served-guard client's wire shapes against a scripted engine (vLLM's and TEI's pooling endpoints):
what it sends, how it reads each answer, and that every failure is a guard that cannot judge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from core.errors import GuardUnavailable
from policies.served.client import ServedModel
from policies.settings import ServedModelSettings
from tests.harness import free_port

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[dict[str, Any]], Any]


class Engine:
    """A scripted pooling server: each path answers through a handler; every request body is kept."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], str | None]] = []
        self.handlers: dict[str, Handler] = {}
        self.status = 200
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, request.headers.get("authorization")))
        if self.status != 200:
            return web.json_response({"error": "boom"}, status=self.status)
        answer = self.handlers[request.path](body)
        if isinstance(answer, str):
            return web.Response(text=answer)
        return web.json_response(answer)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    app = web.Application()
    app.router.add_post("/{tail:.*}", e.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", e.port).start()
    yield e
    await runner.cleanup()


def model(engine: Engine, **kw: Any) -> ServedModel:
    settings = ServedModelSettings(url=f"http://127.0.0.1:{engine.port}", model="guard", max_wait_ms=20, **kw)
    return ServedModel(settings, name="test-guard")


async def test_score_sends_the_pairs_of_concurrent_callers_in_one_call(engine: Engine) -> None:
    engine.handlers["/score"] = lambda b: {
        "data": [{"index": i, "score": len(a) / 100} for i, a in reversed(list(enumerate(b["text_1"])))]
    }
    m = model(engine, api_key="sk-guard")
    try:
        one, two = await asyncio.gather(m.score([("aa", "x"), ("aaa", "y")]), m.score([("a", "z")]))
    finally:
        await m.aclose()
    assert one == [0.02, 0.03] and two == [0.01]
    ((path, body, auth),) = engine.seen
    assert path == "/score" and body == {
        "model": "guard",
        "text_1": ["aa", "aaa", "a"],
        "text_2": ["x", "y", "z"],
    }
    assert auth == "Bearer sk-guard"


@pytest.mark.parametrize("endpoint", ["rerank", "tei-rerank"])
async def test_rerank_calls_once_per_query_and_puts_the_scores_back_in_order(
    engine: Engine, endpoint: str
) -> None:
    def rerank(b: dict[str, Any]) -> Any:
        docs = b.get("documents") or b["texts"]
        rows = [
            {"index": i, "score": float(len(d)), "relevance_score": float(len(d))} for i, d in enumerate(docs)
        ]
        return {"results": rows[::-1]} if endpoint == "rerank" else rows[::-1]

    engine.handlers["/rerank"] = rerank
    m = model(engine, endpoint=endpoint)
    try:
        out = await m.score([("q1", "a"), ("q2", "bbb"), ("q1", "cc")])
    finally:
        await m.aclose()
    assert out == [1.0, 3.0, 2.0]
    assert sorted(b.get("query") for _, b, _ in engine.seen) == ["q1", "q2"]


async def test_classify_names_the_probabilities_by_the_configured_labels(engine: Engine) -> None:
    engine.handlers["/classify"] = lambda b: {
        "data": [
            {"index": i, "label": "b", "probs": [0.1, 0.9] if x == "bad" else [0.8, 0.2], "num_classes": 2}
            for i, x in enumerate(b["input"])
        ]
    }
    m = model(engine, endpoint="classify", labels=["ok", "bad"], truncate_prompt_tokens=-1)
    try:
        out = await m.classify(["fine", "bad", [2, 7, 3]])
    finally:
        await m.aclose()
    assert out == [{"ok": 0.8, "bad": 0.2}, {"ok": 0.1, "bad": 0.9}, {"ok": 0.8, "bad": 0.2}]
    assert engine.seen[0][1] == {
        "model": "guard",
        "input": ["fine", "bad", [2, 7, 3]],
        "truncate_prompt_tokens": -1,
    }


async def test_tei_predict_reads_the_labels_from_the_answer(engine: Engine) -> None:
    engine.handlers["/predict"] = lambda b: [
        [{"label": "SAFE", "score": 0.7}, {"label": "INJECTION", "score": 0.3}] for _ in b["inputs"]
    ]
    m = model(engine, endpoint="tei-predict")
    try:
        out = await m.classify(["one", "two"])
    finally:
        await m.aclose()
    assert out == [{"SAFE": 0.7, "INJECTION": 0.3}] * 2
    assert engine.seen[0][1]["inputs"] == [["one"], ["two"]]


@pytest.mark.parametrize(
    ("status", "answer", "why"),
    [
        (500, None, "HTTP 500"),
        (200, "not json", "no JSON"),
        (200, {"data": [{"index": 0}]}, "wrong shape"),
        (200, {"data": []}, "0 results for 1 inputs"),
        (
            200,
            {"data": [{"index": 0, "probs": [1.0], "num_classes": 1}]},
            "1 classes where the config names 2",
        ),
    ],
)
async def test_every_failure_is_a_guard_that_cannot_judge_and_names_no_address(
    engine: Engine, status: int, answer: Any, why: str
) -> None:
    engine.status = status
    engine.handlers["/score"] = lambda b: answer
    engine.handlers["/classify"] = lambda b: answer
    m = model(engine, endpoint="classify" if "classes" in why else "score", labels=["ok", "bad"])
    try:
        with pytest.raises(GuardUnavailable) as caught:
            if "classes" in why:
                await m.classify(["x"])
            else:
                await m.score([("a", "b")])
    finally:
        await m.aclose()
    assert why in caught.value.message and "127.0.0.1" not in caught.value.message


async def test_a_refused_connection_is_a_guard_that_cannot_judge() -> None:
    m = ServedModel(ServedModelSettings(url=f"http://127.0.0.1:{free_port()}", model="guard", max_wait_ms=0))
    try:
        with pytest.raises(GuardUnavailable, match="unreachable"):
            await m.score([("a", "b")])
    finally:
        await m.aclose()


@pytest.mark.parametrize(
    ("served", "extra", "field"),
    [
        (None, {}, "grounding.served"),
        ({"endpoint": "tei-predict"}, {}, "grounding.served.endpoint"),
        ({"endpoint": "transcriptions"}, {}, "grounding.served.endpoint"),
        ({"endpoint": "classify", "labels": ["entailment", "neutral"]}, {}, "grounding.tokenizer"),
    ],
)
def test_a_served_grounding_scorer_names_what_its_config_lacks(served: Any, extra: dict, field: str) -> None:
    from pydantic import ValidationError

    from policies.settings import GroundingSettings

    block = None if served is None else {"url": "http://nli:8000", "model": "nli", **served}
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        GroundingSettings(scorer="served", served=block, **extra)


async def test_transcribe_posts_the_file_and_reads_the_text(engine: Engine) -> None:
    got: dict[str, Any] = {}

    async def transcriptions(request: web.Request) -> web.Response:
        form = await request.post()
        upload = form["file"]
        upload_bytes = upload.file.read() if isinstance(upload, web.FileField) else b""
        got.update(model=form["model"], language=form.get("language"), bytes=upload_bytes)
        return web.json_response({"text": "hello there"})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    m = ServedModel(
        ServedModelSettings(url=f"http://127.0.0.1:{port}", model="whisper", endpoint="transcriptions"),
        name="stt",
    )
    try:
        assert await m.transcribe(b"RIFF....WAVE", language="en") == "hello there"
    finally:
        await m.aclose()
        await runner.cleanup()
    assert got == {"model": "whisper", "language": "en", "bytes": b"RIFF....WAVE"}


async def test_a_transcription_past_its_deadline_is_a_guard_that_cannot_judge() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"text": "late"})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    settings = ServedModelSettings(
        url=f"http://127.0.0.1:{port}", model="w", endpoint="transcriptions", timeout_s=0.3
    )
    m = ServedModel(settings, name="stt")
    try:
        with pytest.raises(GuardUnavailable, match="did not answer within"):
            await m.transcribe(b"x")
    finally:
        await m.aclose()
        await runner.cleanup()
