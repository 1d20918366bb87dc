"""The served guards' micro-batcher, without an engine: windows, the batch size, deadlines, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.errors import GuardUnavailable
from policies.served.batcher import MicroBatcher

pytestmark = pytest.mark.timeout(30)


class Engine:
    """The call a batcher makes, recorded: each call's items; answers each item with its double."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None) -> None:
        self.calls: list[list[int]] = []
        self.delay = delay
        self.fail = fail
        self.running = 0
        self.most = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.release.wait()
            await asyncio.sleep(self.delay)
            if self.fail is not None:
                raise self.fail
            return [2 * x for x in items]
        finally:
            self.running -= 1


def batcher(engine: Engine, **kw: float) -> MicroBatcher[int, int]:
    args: dict = {"max_batch": 8, "max_wait_s": 0.05, "deadline_s": 5.0, "max_inflight": 4} | kw
    return MicroBatcher(engine, **args)


async def test_concurrent_jobs_in_one_window_make_one_call() -> None:
    engine = Engine()
    b = batcher(engine)
    results = await asyncio.gather(*(b.submit([i, i + 100]) for i in range(3)))
    assert results == [[0, 200], [2, 202], [4, 204]]
    assert engine.calls == [[0, 100, 1, 101, 2, 102]]
    assert b.stats.calls == 1 and b.stats.items == 6
    await b.aclose()


async def test_a_lone_job_waits_at_most_the_window() -> None:
    engine = Engine()
    b = batcher(engine, max_wait_s=0.1)
    t0 = time.perf_counter()
    assert await b.submit([1]) == [2]
    waited = time.perf_counter() - t0
    assert 0.09 <= waited < 0.5, waited
    await b.aclose()


async def test_the_batch_closes_at_max_batch_without_waiting_out_the_window() -> None:
    engine = Engine()
    b = batcher(engine, max_batch=4, max_wait_s=10.0)
    t0 = time.perf_counter()
    out = await asyncio.gather(b.submit([1, 2]), b.submit([3, 4]))
    assert out == [[2, 4], [6, 8]] and time.perf_counter() - t0 < 1.0
    assert engine.calls == [[1, 2, 3, 4]]
    await b.aclose()


async def test_jobs_that_overflow_a_batch_go_in_the_next_call_and_a_large_job_goes_alone() -> None:
    engine = Engine()
    b = batcher(engine, max_batch=4)
    out = await asyncio.gather(b.submit([1, 2, 3]), b.submit([4, 5]), b.submit(list(range(10, 16))))
    assert out == [[2, 4, 6], [8, 10], [20, 22, 24, 26, 28, 30]]
    assert sorted(engine.calls) == sorted([[1, 2, 3], [4, 5], [10, 11, 12, 13, 14, 15]])
    assert b.stats.largest == 6  # never cut: a job's items are judged together
    await b.aclose()


async def test_an_engine_past_the_deadline_is_a_guard_that_cannot_judge() -> None:
    engine = Engine()
    engine.release.clear()  # the engine never answers
    b = batcher(engine, deadline_s=0.3)
    t0 = time.perf_counter()
    with pytest.raises(GuardUnavailable, match=r"did not answer within 0\.3 s"):
        await b.submit([1])
    assert time.perf_counter() - t0 < 1.0
    engine.release.set()
    await b.aclose()


async def test_an_engine_failure_reaches_every_caller_of_the_batch() -> None:
    engine = Engine(fail=RuntimeError("boom"))
    b = batcher(engine)
    out = await asyncio.gather(b.submit([1]), b.submit([2]), return_exceptions=True)
    assert all(isinstance(e, GuardUnavailable) for e in out), out
    assert len(engine.calls) == 1 and b.stats.failures == 1
    await b.aclose()


async def test_a_wrong_number_of_results_is_a_failure_not_a_misattribution() -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    b: MicroBatcher[int, int] = MicroBatcher(short, max_batch=8, max_wait_s=0.01, deadline_s=5)
    with pytest.raises(GuardUnavailable, match="2 results for 3 inputs"):
        await b.submit([1, 2, 3])
    await b.aclose()


async def test_a_cancelled_caller_gives_its_place_in_the_window_back() -> None:
    engine = Engine()
    b = batcher(engine, max_batch=4, max_wait_s=0.2)
    gone = asyncio.create_task(b.submit([1, 2, 3]))
    await asyncio.sleep(0.02)
    assert b.waiting == 3
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert b.waiting == 0
    # The window is empty again: a job of 4 fits whole, and the cancelled items are never sent.
    assert await b.submit([7, 8, 9, 10]) == [14, 16, 18, 20]
    assert engine.calls == [[7, 8, 9, 10]]
    await b.aclose()


async def test_a_caller_cancelled_while_its_batch_waits_for_a_slot_is_not_sent() -> None:
    engine = Engine()
    engine.release.clear()
    b = batcher(engine, max_batch=1, max_inflight=1)
    first = asyncio.create_task(b.submit([1]))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(b.submit([2]))  # its batch waits for the only slot
    await asyncio.sleep(0.02)
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    engine.release.set()
    assert await first == [2]
    await asyncio.sleep(0.05)
    assert engine.calls == [[1]]
    await b.aclose()


async def test_calls_in_flight_are_bounded() -> None:
    engine = Engine(delay=0.05)
    b = batcher(engine, max_batch=1, max_inflight=2)
    out = await asyncio.gather(*(b.submit([i]) for i in range(6)))
    assert out == [[2 * i] for i in range(6)]
    assert engine.most == 2 and len(engine.calls) == 6
    await b.aclose()


async def test_a_closed_batcher_refuses_and_fails_what_waits() -> None:
    engine = Engine()
    b = batcher(engine, max_wait_s=5.0)
    waiting = asyncio.create_task(b.submit([1]))
    await asyncio.sleep(0.02)
    await b.aclose()
    with pytest.raises(GuardUnavailable, match="closed"):
        await waiting
    with pytest.raises(GuardUnavailable, match="closed"):
        await b.submit([2])
    assert engine.calls == []
