"""The one attempt loop both request paths share (gateway/pipeline/attempt.py), with scripted engines:
failover before an answer, the lease handed to the request on success, every slot settled once."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from core.context import RequestContext
from core.errors import EngineFailed, EngineRejected, EngineUnavailable
from core.events import Completion, Delta
from core.schemas import ChatCompletionRequest
from engines.adapters.settings import EngineConfig
from engines.selection.pool import EnginePool, build_engine
from gateway.pipeline.attempt import Attempts, first_chunk
from observability.metrics import Metrics

pytestmark = pytest.mark.timeout(30)


class Script:
    """What each engine does when called: an error to raise, or an answer."""

    def __init__(self, **by_engine: object) -> None:
        self.by_engine = by_engine
        self.calls: list[str] = []

    async def __call__(self, engine, request: ChatCompletionRequest) -> str:
        self.calls.append(engine.name)
        outcome = self.by_engine[engine.name]
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome == "hang":
            await asyncio.sleep(30)
        return f"answer from {engine.name}"


def _setup(*names: str) -> tuple[EnginePool, Attempts, Metrics]:
    engines = [
        build_engine(
            EngineConfig(
                name=n,
                kind="vllm",
                base_url="http://127.0.0.1:9/v1",
                model="m",
                serves=["x"],
                weight=1.0 if i == 0 else 0.0,
            )
        )
        for i, n in enumerate(names)
    ]
    metrics = Metrics(CollectorRegistry())
    pool = EnginePool(engines, metrics)
    for e in engines:
        pool._set_health(e, True)
    return pool, Attempts(pool, metrics), metrics


def _request() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    )


def _ctx() -> RequestContext:
    return RequestContext.new(secrets.token_hex(8))


def _busy(pool: EnginePool) -> dict[str, int]:
    return {name: pool.in_flight(name) for name in pool.engines}


async def test_the_first_engine_that_answers_keeps_its_slot_as_the_requests_lease():
    pool, attempts, _ = _setup("a", "b")
    script = Script(a="ok", b="ok")
    ctx = _ctx()
    answered = await attempts.call(_request(), ctx, script)
    assert answered.result == "answer from a" and script.calls == ["a"]
    assert ctx.record.engine == "a" and ctx.record.attempts == 1 and ctx.lease is not None and ctx.lease.held
    assert _busy(pool) == {"a": 1, "b": 0}
    attempts.unbind(ctx)  # a retry or the next segment gives it back, once
    attempts.unbind(ctx)
    assert ctx.record.engine is None and ctx.lease is None and _busy(pool) == {"a": 0, "b": 0}


async def test_an_engine_error_that_allows_failover_moves_on_and_settles_the_failed_slot():
    pool, attempts, metrics = _setup("a", "b")
    script = Script(a=EngineFailed("engine a failed", engine="a"), b="ok")
    ctx = _ctx()
    answered = await attempts.call(_request(), ctx, script)
    assert answered.engine.name == "b" and script.calls == ["a", "b"] and ctx.record.attempts == 2
    assert _busy(pool) == {"a": 0, "b": 1}
    assert pool._circuits["a"].consecutive == 1  # type: ignore[attr-defined]
    assert metrics.registry.get_sample_value("omnigate_engine_failovers_total", {"engine": "a"}) == 1
    ctx.lease.settle(reported=True)  # type: ignore[union-attr]
    assert _busy(pool) == {"a": 0, "b": 0}


async def test_an_engine_error_without_failover_ends_the_loop_with_every_slot_given_back():
    pool, attempts, _ = _setup("a", "b")
    # The engine refused the request itself: another engine would too.
    script = Script(a=EngineRejected("engine a refused the request", upstream_status=400, engine="a"), b="ok")
    ctx = _ctx()
    with pytest.raises(EngineRejected):
        await attempts.call(_request(), ctx, script)
    assert script.calls == ["a"] and ctx.lease is None and ctx.record.engine is None
    assert _busy(pool) == {"a": 0, "b": 0}
    assert pool._circuits["a"].consecutive == 0  # type: ignore[attr-defined]


async def test_every_engine_failing_raises_the_last_error_with_no_slot_held():
    pool, attempts, _ = _setup("a", "b")
    script = Script(
        a=EngineUnavailable("engine a refused", engine="a"),
        b=EngineUnavailable("engine b refused", engine="b"),
    )
    with pytest.raises(EngineUnavailable) as raised:
        await attempts.call(_request(), _ctx(), script)
    assert raised.value.detail == "engine b refused" and script.calls == ["a", "b"]
    assert _busy(pool) == {"a": 0, "b": 0}


async def test_cancelled_mid_call_the_slot_is_given_back_and_the_request_holds_none():
    pool, attempts, _ = _setup("a", "b")
    ctx = _ctx()
    task = asyncio.create_task(attempts.call(_request(), ctx, Script(a="hang", b="ok")))
    await asyncio.sleep(0.05)
    assert _busy(pool) == {"a": 1, "b": 0}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _busy(pool) == {"a": 0, "b": 0} and ctx.lease is None


async def test_the_stream_call_reads_up_to_the_first_chunk_and_an_empty_stream_fails_over():
    pool, attempts, _ = _setup("a", "b")
    closed: list[str] = []

    def scripted(name: str, deltas: list[Delta]):
        async def stream(request: ChatCompletionRequest) -> AsyncGenerator[Delta, None]:
            try:
                for d in deltas:
                    yield d
            finally:
                closed.append(name)

        return stream

    pool.engines["a"].stream = scripted("a", [])  # type: ignore[method-assign]
    pool.engines["b"].stream = scripted("b", [Delta(text="hel"), Delta(text="lo")])  # type: ignore[method-assign]
    ctx = _ctx()
    # An empty stream is the engine's fault (a protocol error): nothing has been sent, so b is tried.
    answered = await attempts.call(_request(), ctx, first_chunk)
    upstream, first = answered.result
    assert first.text == "hel" and answered.engine.name == "b" and closed == ["a"]
    assert _busy(pool) == {"a": 0, "b": 1}
    await upstream.aclose()
    attempts.unbind(ctx)
    assert _busy(pool) == {"a": 0, "b": 0}
    pool.engines["a"].stream = scripted("a", [Delta(text="hi")])  # type: ignore[method-assign]
    answered = await attempts.call(_request(), ctx, first_chunk)
    upstream, first = answered.result
    assert first.text == "hi" and answered.engine.name == "a" and _busy(pool) == {"a": 1, "b": 0}
    await upstream.aclose()
    ctx.lease.settle(reported=True)  # type: ignore[union-attr]
    assert _busy(pool) == {"a": 0, "b": 0}


async def test_a_whole_answer_is_the_json_paths_call():
    pool, attempts, _ = _setup("a")

    async def complete(request: ChatCompletionRequest) -> Completion:
        out = Completion()
        out.text = "whole"
        return out

    pool.engines["a"].complete = complete  # type: ignore[method-assign]
    ctx = _ctx()
    answered = await attempts.call(_request(), ctx, lambda engine, req: engine.complete(req))
    assert answered.result.text == "whole" and _busy(pool) == {"a": 1}
    attempts.unbind(ctx)
    assert _busy(pool) == {"a": 0}


async def test_one_request_reads_one_view_for_its_order_and_its_claims():
    """A view published while the request fails over (here, one that caps the second engine at zero) is
    not half-applied: the request's order and every claim it makes read the view it began with."""
    from engines.rollout.routing import RoutingTable

    pool, attempts, _ = _setup("a", "b")
    began = pool.view
    script = Script(a=EngineFailed("down", engine="a"), b="ok")

    async def call(engine, request):
        if engine.name == "a":
            table = RoutingTable(weights=began.table.weights, limits={"b": 0})
            pool.set_table(table)  # control publishes mid-request
        return await script(engine, request)

    ctx = _ctx()
    answered = await attempts.call(_request(), ctx, call)
    assert answered.engine.name == "b" and script.calls == ["a", "b"]
    assert pool.view.generation == began.generation + 1 and pool.limit("b") == 0
    ctx.lease.settle(reported=True)  # type: ignore[union-attr]
