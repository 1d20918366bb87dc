"""The lease a request holds on an engine slot: settled exactly once in ``__aexit__``, whatever ends the
engine call (success handed on, engine errors with and without failover, cancellation, a bug), and
never released twice."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import pytest
from prometheus_client import CollectorRegistry

from core.errors import EngineProtocolError, EngineTimeout
from engines.adapters.settings import EngineConfig
from engines.selection.pool import EnginePool, Lease, build_engine
from observability.metrics import Metrics

pytestmark = pytest.mark.timeout(30)


def _engine(name: str, **kw):
    return build_engine(
        EngineConfig(name=name, kind="vllm", base_url="http://127.0.0.1:9/v1", model="m", serves=["x"], **kw)
    )


def _pool(*engines) -> EnginePool:
    pool = EnginePool(engines, Metrics(CollectorRegistry()))
    for e in engines:
        pool._set_health(e, True)
    return pool


def _failures(pool: EnginePool, name: str) -> int:
    return pool._circuits[name].consecutive  # type: ignore[attr-defined]


async def test_a_lease_claims_a_slot_and_gives_it_back_when_the_block_ends_without_keeping_it():
    a = _engine("a", max_in_flight=1)
    pool = _pool(a)
    lease = await pool.lease([a], "x")
    assert isinstance(lease, Lease) and lease.engine is a and pool.in_flight("a") == 1
    async with lease:
        pass  # e.g. the engine cannot take this request's modalities: no call was made
    assert not lease.held and pool.in_flight("a") == 0 and _failures(pool, "a") == 0


async def test_a_kept_lease_outlives_its_block_and_settles_once_however_often_it_is_settled():
    a = _engine("a", max_in_flight=1)
    pool = _pool(a)
    lease = await pool.lease([a], "x")
    assert lease is not None
    async with lease:
        lease.keep()
    assert lease.held and pool.in_flight("a") == 1
    waiter = asyncio.create_task(pool.claim([a], "x"))
    await asyncio.sleep(0.01)
    lease.settle(reported=True)  # the slot goes to the waiter ...
    assert (await asyncio.wait_for(waiter, 2)) is a and pool.in_flight("a") == 1
    lease.settle(reported=False)  # ... and a second settle does not take the waiter's slot away
    lease.settle(reported=True)
    assert pool.in_flight("a") == 1
    pool.release(a)
    assert pool.in_flight("a") == 0


async def test_an_engine_error_that_allows_failover_counts_against_the_circuit_then_settles():
    a = _engine("a")
    pool = _pool(a)
    lease = await pool.lease([a], "x")
    assert lease is not None
    with pytest.raises(EngineTimeout):
        async with lease:
            raise EngineTimeout("engine a timed out", engine="a")
    assert not lease.held and pool.in_flight("a") == 0 and _failures(pool, "a") == 1
    lease.settle(reported=True)
    assert pool.in_flight("a") == 0 and _failures(pool, "a") == 1


async def test_an_engine_error_without_failover_gives_the_slot_back_without_an_outcome():
    a = _engine("a")
    pool = _pool(a)
    circuit = pool._circuits["a"]
    circuit.cfg = circuit.cfg.model_copy(update={"half_open_trials": 1})  # type: ignore[attr-defined]
    circuit._open()  # type: ignore[attr-defined]
    circuit.open_until = 0.0  # type: ignore[attr-defined]
    lease = await pool.lease([a], "x")  # takes the one half-open trial
    assert lease is not None and circuit.trials == 1  # type: ignore[attr-defined]
    error = EngineProtocolError("bad request upstream", engine="a")
    error.retryable = False
    with pytest.raises(EngineProtocolError):
        async with lease:
            raise error
    assert pool.in_flight("a") == 0 and circuit.trials == 0  # type: ignore[attr-defined]
    assert _failures(pool, "a") == 0


async def test_cancellation_inside_the_block_gives_the_slot_back_once():
    a = _engine("a", max_in_flight=1)
    pool = _pool(a)
    entered = asyncio.Event()

    async def call() -> None:
        lease = await pool.lease([a], "x")
        assert lease is not None
        async with lease:
            entered.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(call())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.in_flight("a") == 0 and _failures(pool, "a") == 0


async def test_a_lease_keeps_nothing_of_the_error_that_ended_its_block():
    a = _engine("a")
    pool = _pool(a)

    class Payload:
        pass

    lease = await pool.lease([a], "x")
    assert lease is not None
    refs: list[weakref.ref[Payload]] = []

    async def call(lease: Lease) -> None:
        payload = Payload()  # held by this frame, which the error's traceback holds
        refs.append(weakref.ref(payload))
        async with lease:
            raise EngineTimeout("engine a timed out", engine="a")

    gc.disable()
    try:
        # the error is dropped here: with the collector off, only a reference kept elsewhere holds its frame
        with contextlib.suppress(EngineTimeout):
            await call(lease)
        assert refs[0]() is None
        assert not lease.held
    finally:
        gc.enable()


async def test_no_engine_to_claim_is_no_lease():
    a = _engine("a")
    pool = _pool(a)
    assert await pool.lease([], "x") is None
    assert pool.in_flight("a") == 0
