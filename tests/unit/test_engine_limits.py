"""Per-engine concurrency caps in the engine pool: configured and routing-table caps, spill-over, fair bounded
waiting with hand-over, overload caps, circuits, and no leaks."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from core.errors import EngineBusy
from engines.adapters.settings import EngineConfig
from engines.rollout.routing import RoutingTable
from engines.selection.pool import EnginePool, build_engine
from observability.metrics import Metrics

pytestmark = pytest.mark.timeout(30)


def _engine(name: str, **kw):
    return build_engine(
        EngineConfig(name=name, kind="vllm", base_url="http://127.0.0.1:9/v1", model="m", serves=["x"], **kw)
    )


def _pool(*engines, healthy: bool = True) -> tuple[EnginePool, Metrics]:
    metrics = Metrics(CollectorRegistry())
    pool = EnginePool(engines, metrics)
    if healthy:
        for e in engines:
            pool._set_health(e, True)
    return pool, metrics


def _counts(pool: EnginePool) -> dict[str, tuple[int, int]]:
    return {name: (v["in_flight"], v["waiting"]) for name, v in pool.concurrency().items()}


def _shed(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("omnigate_admission_shed_total", {"reason": reason}) or 0.0


async def test_default_cap_is_eight_then_spill_over_to_the_next_engine():
    a, b = _engine("a"), _engine("b", max_in_flight=1)
    pool, metrics = _pool(a, b)
    assert pool.limit("a") == 8
    got = [await pool.claim([a, b]) for _ in range(9)]
    assert [e.name for e in got] == ["a"] * 8 + ["b"]
    assert _counts(pool) == {"a": (8, 0), "b": (1, 0)}
    assert metrics.registry.get_sample_value("omnigate_engine_in_flight", {"engine": "a"}) == 8
    assert not pool.acquire(a) and not pool.acquire(b)
    for e in got:
        pool.release(e)
    assert _counts(pool) == {"a": (0, 0), "b": (0, 0)}


async def test_the_routing_tables_limit_lowers_the_cap_and_lifting_it_lets_waiters_in():
    a = _engine("a", max_in_flight=4)
    pool, metrics = _pool(a)
    pool.set_table(RoutingTable(version=2, weights=pool.table.weights, limits={"a": 2}))
    assert pool.limit("a") == 2
    assert metrics.registry.get_sample_value("omnigate_engine_concurrency_limit", {"engine": "a"}) == 2
    held = [await pool.claim([a]) for _ in range(2)]
    waiting = asyncio.create_task(pool.claim([a]))
    await asyncio.sleep(0.01)
    assert _counts(pool) == {"a": (2, 1)}
    pool.set_table(RoutingTable(version=3, weights=pool.table.weights))  # restored: cap 4 again
    held.append(await asyncio.wait_for(waiting, 2))
    assert _counts(pool) == {"a": (3, 0)} and pool.limit("a") == 4
    # A routing limit above the configured cap does not raise it.
    pool.set_table(RoutingTable(version=4, weights=pool.table.weights, limits={"a": 50}))
    assert pool.limit("a") == 4
    for e in held:
        pool.release(e)
    assert _counts(pool) == {"a": (0, 0)}


async def test_waiters_are_served_in_arrival_order_by_hand_over():
    a = _engine("a", max_in_flight=1, max_waiting=8)
    pool, _ = _pool(a)
    first = await pool.claim([a])
    order: list[int] = []

    async def wait(i: int):
        engine = await pool.claim([a])
        order.append(i)
        await asyncio.sleep(0)
        pool.release(engine)

    tasks = [asyncio.create_task(wait(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert _counts(pool) == {"a": (1, 5)}
    assert not pool.acquire(a)  # a newcomer does not overtake the queue
    pool.release(first)  # the slot is handed to the oldest waiter
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert _counts(pool) == {"a": (0, 0)}


async def test_a_waiter_takes_the_first_slot_any_of_its_engines_frees():
    a, b = _engine("a", max_in_flight=1), _engine("b", max_in_flight=1)
    pool, _ = _pool(a, b)
    ea, eb = await pool.claim([a, b]), await pool.claim([a, b])
    waiting = asyncio.create_task(pool.claim([a, b]))
    await asyncio.sleep(0.01)
    assert _counts(pool) == {"a": (1, 1), "b": (1, 1)}
    pool.release(eb)
    got = await waiting
    assert got is b
    assert _counts(pool) == {"a": (1, 0), "b": (1, 0)}
    pool.release(got)
    pool.release(ea)
    assert _counts(pool) == {"a": (0, 0), "b": (0, 0)}


async def test_full_queue_is_busy_at_once_and_a_timed_out_wait_leaks_nothing():
    a = _engine("a", max_in_flight=1, max_waiting=1, max_wait_s=0.1)
    pool, metrics = _pool(a)
    held = await pool.claim([a], "x")
    waiter = asyncio.create_task(pool.claim([a], "x"))
    await asyncio.sleep(0.01)
    with pytest.raises(EngineBusy) as info:
        await pool.claim([a], "x")  # queue full
    assert info.value.status == 503 and info.value.code == "engine_busy" and info.value.retry_after
    with pytest.raises(EngineBusy):
        await waiter  # waited max_wait_s
    assert _counts(pool) == {"a": (1, 0)}
    pool.release(held)
    assert _counts(pool) == {"a": (0, 0)}
    assert _shed(metrics, "engine_busy") == 2


async def test_cancelled_waiter_leaves_no_trace_and_a_hand_over_to_it_passes_on():
    a = _engine("a", max_in_flight=1)
    pool, _ = _pool(a)
    held = await pool.claim([a])
    cancelled = asyncio.create_task(pool.claim([a]))
    second = asyncio.create_task(pool.claim([a]))
    await asyncio.sleep(0.01)
    # The slot is handed to the first waiter and that waiter is cancelled in the same loop turn.
    pool.release(held)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    got = await asyncio.wait_for(second, 2)
    assert _counts(pool) == {"a": (1, 0)}
    pool.release(got)
    assert _counts(pool) == {"a": (0, 0)}


async def test_overload_lowers_caps_to_four_by_default_and_recovery_wakes_waiters():
    a = _engine("a", max_in_flight=4, max_in_flight_overloaded=2)
    pool, metrics = _pool(a)
    assert _engine("b").config.overload_limit() == 4  # the seeds' defaults: 8, and 4 under overload
    held = [await pool.claim([a]) for _ in range(3)]
    pool.set_overloaded(True)
    assert metrics.registry.get_sample_value("omnigate_engine_concurrency_limit", {"engine": "a"}) == 2
    blocked = asyncio.create_task(pool.claim([a]))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    pool.release(held.pop())  # 2 in flight: still at the overload cap, no hand-over
    await asyncio.sleep(0.01)
    assert not blocked.done() and _counts(pool) == {"a": (2, 1)}
    pool.set_overloaded(False)  # cap back to 4: the waiter gets in
    held.append(await asyncio.wait_for(blocked, 2))
    assert _counts(pool) == {"a": (3, 0)}
    for e in held:
        pool.release(e)
    assert _counts(pool) == {"a": (0, 0)}


async def test_no_cap_means_unlimited():
    a = _engine("a", max_in_flight=None)
    pool, metrics = _pool(a)
    got = [await pool.claim([a]) for _ in range(100)]
    assert metrics.registry.get_sample_value("omnigate_engine_concurrency_limit", {"engine": "a"}) == -1
    for e in got:
        pool.release(e)
    assert _counts(pool) == {"a": (0, 0)}


def test_overload_cap_may_not_exceed_the_normal_one():
    with pytest.raises(ValueError, match="max_in_flight_overloaded"):
        _engine("a", max_in_flight=4, max_in_flight_overloaded=8)


async def test_load_spills_over_only_to_healthy_engines():
    a, b = _engine("a", max_in_flight=1), _engine("b", max_in_flight=1)
    pool, _ = _pool(a, b, healthy=False)
    pool._set_health(a, True)
    held = await pool.claim([a, b])
    waiting = asyncio.create_task(pool.claim([a, b]))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # b is unhealthy: the request waits for a instead of spilling over
    pool.release(held)
    assert (await asyncio.wait_for(waiting, 2)) is a
    pool._set_health(a, False)
    assert (await pool.claim([a, b])) is b  # with no available engine left, the others are tried


async def test_waiters_of_an_ejected_engine_look_again_instead_of_waiting_out_their_time():
    a, b = _engine("a", max_in_flight=1), _engine("b", max_in_flight=1)
    pool, _ = _pool(a, b)
    pool._set_health(b, False)
    held = await pool.claim([a, b])
    waiting = asyncio.create_task(pool.claim([a, b]))
    await asyncio.sleep(0.01)
    assert _counts(pool) == {"a": (1, 1), "b": (0, 0)}
    for _ in range(5):
        pool.report_failure(a)  # a's circuit opens: no available engine is left for the waiter
    assert pool.circuit_state("a") == "open"
    assert (await asyncio.wait_for(waiting, 2)) is b  # the last resort, at once
    pool.release(held, settled=False)
    pool.release(b, settled=False)
    assert _counts(pool) == {"a": (0, 0), "b": (0, 0)}


async def test_a_half_open_engine_hands_its_trial_to_one_waiter_only():
    a, b = _engine("a", max_in_flight=2), _engine("b")
    pool, _ = _pool(a, b)  # b stays available, so a half-open a is not tried in panic
    pool._circuits["a"].cfg = pool._circuits["a"].cfg.model_copy(update={"half_open_trials": 1})
    held = [await pool.claim([a]) for _ in range(2)]
    waiters = [asyncio.create_task(pool.claim([a])) for _ in range(2)]
    await asyncio.sleep(0.01)
    circuit = pool._circuits["a"]
    circuit._open()
    circuit.open_until = 0.0  # the ejection is over: half-open, one trial
    pool.release(held.pop())  # the slot goes to the first waiter, with the trial
    first = await asyncio.wait_for(waiters[0], 2)
    assert first is a and circuit.current() == "half_open" and circuit.trials == 1
    assert not waiters[1].done()
    pool.release(held.pop())  # no trial left: the slot is not handed on
    await asyncio.sleep(0.01)
    assert not waiters[1].done() and _counts(pool)["a"] == (1, 1)
    pool.report_success(a, 0.1, None, 0.2)  # the trial succeeded: closed, the waiter gets in
    pool.release(first)
    assert (await asyncio.wait_for(waiters[1], 2)) is a
    pool.release(a)
    assert _counts(pool)["a"] == (0, 0)
