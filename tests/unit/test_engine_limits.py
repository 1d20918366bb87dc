"""Per-engine concurrency slots: limits, spill-over, fair bounded waiting, overload limits, no leaks."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from engines.limits import EngineSlots
from engines.pool import EnginePool, build_engine
from gateway.errors import EngineBusy
from gateway.settings import EngineConfig
from observability.metrics import Metrics

pytestmark = pytest.mark.timeout(30)


def _engine(name: str, **kw):
    return build_engine(EngineConfig(name=name, kind="vllm", base_url="http://127.0.0.1:9/v1", model="m",
                                     serves=["x"], **kw))


def _slots(*engines) -> tuple[EngineSlots, Metrics]:
    metrics = Metrics(CollectorRegistry())
    return EngineSlots(engines, metrics), metrics


def _counts(slots: EngineSlots) -> dict[str, tuple[int, int]]:
    return {name: (v["in_flight"], v["waiting"]) for name, v in slots.snapshot().items()}


async def test_limit_then_spill_over_to_the_next_engine():
    a, b = _engine("a", max_in_flight=2), _engine("b", max_in_flight=1)
    slots, metrics = _slots(a, b)
    got = [await slots.acquire([a, b]) for _ in range(3)]
    assert [s.engine.name for s in got] == ["a", "a", "b"]
    assert _counts(slots) == {"a": (2, 0), "b": (1, 0)}
    assert metrics.registry.get_sample_value("omnigate_engine_in_flight", {"engine": "a"}) == 2
    for s in got:
        s.release()
        s.release()  # idempotent
    assert _counts(slots) == {"a": (0, 0), "b": (0, 0)}


async def test_waiters_are_served_in_arrival_order_by_handover():
    a = _engine("a", max_in_flight=1, max_waiting=8)
    slots, _ = _slots(a)
    first = await slots.acquire([a])
    order: list[int] = []

    async def wait(i: int):
        slot = await slots.acquire([a])
        order.append(i)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.create_task(wait(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert _counts(slots) == {"a": (1, 5)}
    # A newcomer does not overtake the queue when a slot frees: the slot is handed to the oldest waiter.
    first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert _counts(slots) == {"a": (0, 0)}


async def test_a_waiter_takes_the_first_slot_any_of_its_engines_frees():
    a, b = _engine("a", max_in_flight=1), _engine("b", max_in_flight=1)
    slots, _ = _slots(a, b)
    sa, sb = await slots.acquire([a, b]), await slots.acquire([a, b])
    waiting = asyncio.create_task(slots.acquire([a, b]))
    await asyncio.sleep(0.01)
    assert _counts(slots) == {"a": (1, 1), "b": (1, 1)}
    sb.release()
    got = await waiting
    assert got.engine.name == "b"
    assert _counts(slots) == {"a": (1, 0), "b": (1, 0)}
    got.release()
    sa.release()
    assert _counts(slots) == {"a": (0, 0), "b": (0, 0)}


async def test_full_queue_is_busy_at_once_and_a_timed_out_wait_leaks_nothing():
    a = _engine("a", max_in_flight=1, max_waiting=1, max_wait_s=0.1)
    slots, metrics = _slots(a)
    held = await slots.acquire([a], "x")
    waiter = asyncio.create_task(slots.acquire([a], "x"))
    await asyncio.sleep(0.01)
    with pytest.raises(EngineBusy) as info:
        await slots.acquire([a], "x")  # queue full
    assert info.value.status == 503 and info.value.code == "engine_busy" and info.value.retry_after
    with pytest.raises(EngineBusy):
        await waiter  # waited max_wait_s
    assert _counts(slots) == {"a": (1, 0)}
    held.release()
    assert _counts(slots) == {"a": (0, 0)}
    assert metrics.registry.get_sample_value("omnigate_engine_busy_total", {"model": "x"}) == 2


async def test_cancelled_waiter_leaves_no_trace_and_a_handover_to_it_passes_on():
    a = _engine("a", max_in_flight=1)
    slots, _ = _slots(a)
    held = await slots.acquire([a])
    cancelled = asyncio.create_task(slots.acquire([a]))
    second = asyncio.create_task(slots.acquire([a]))
    await asyncio.sleep(0.01)
    # The slot is handed to the first waiter and that waiter is cancelled in the same loop turn.
    held.release()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    got = await asyncio.wait_for(second, 2)
    assert _counts(slots) == {"a": (1, 0)}
    got.release()
    assert _counts(slots) == {"a": (0, 0)}


async def test_overload_lowers_limits_and_recovery_wakes_waiters():
    a = _engine("a", max_in_flight=4, max_in_flight_overloaded=2)
    slots, metrics = _slots(a)
    held = [await slots.acquire([a]) for _ in range(3)]
    slots.set_overloaded(True)
    assert metrics.registry.get_sample_value("omnigate_engine_concurrency_limit", {"engine": "a"}) == 2
    blocked = asyncio.create_task(slots.acquire([a]))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    held.pop().release()  # 2 in flight: still at the overload limit, no handover
    await asyncio.sleep(0.01)
    assert not blocked.done() and _counts(slots) == {"a": (2, 1)}
    slots.set_overloaded(False)  # limit back to 4: the waiter gets in
    held.append(await asyncio.wait_for(blocked, 2))
    assert _counts(slots) == {"a": (3, 0)}
    for s in held:
        s.release()
    assert _counts(slots) == {"a": (0, 0)}


async def test_no_limit_means_unlimited():
    a = _engine("a", max_in_flight=None)
    slots, metrics = _slots(a)
    got = [await slots.acquire([a]) for _ in range(100)]
    assert metrics.registry.get_sample_value("omnigate_engine_concurrency_limit", {"engine": "a"}) == -1
    for s in got:
        s.release()
    assert _counts(slots) == {"a": (0, 0)}


def test_overload_limit_may_not_exceed_the_normal_one():
    with pytest.raises(ValueError, match="max_in_flight_overloaded"):
        _engine("a", max_in_flight=4, max_in_flight_overloaded=8)


async def test_load_spills_over_only_to_healthy_engines():
    a, b = _engine("a", max_in_flight=1), _engine("b", max_in_flight=1)
    pool = EnginePool([a, b], Metrics(CollectorRegistry()))
    pool._set_health(a, True)
    held = await pool.acquire([a, b])
    waiting = asyncio.create_task(pool.acquire([a, b]))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # b is unhealthy: the request waits for a instead of spilling over
    held.release()
    assert (await asyncio.wait_for(waiting, 2)).engine is a
    pool.report_failure(a)
    last_resort = await pool.acquire([b])
    assert last_resort.engine is b  # with no healthy engine left, the unhealthy one is tried
