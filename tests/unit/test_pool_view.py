"""The pool's view: control publishes one immutable view (routing table, overload, generation) by swapping a
reference; a request reads it once; the data plane reacts to a new view on its own (waiters let in when a cap
rises), and hands its transitions to whoever subscribed, with nothing set on it from outside."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from engines.adapters.settings import EngineConfig
from engines.rollout.rollback import Transition
from engines.rollout.routing import RoutingTable
from engines.selection.pool import EnginePool, build_engine
from engines.selection.view import View
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


def test_a_view_is_frozen_and_the_next_one_is_built_from_the_current_one():
    pool = _pool(_engine("a"))
    first = pool.view
    with pytest.raises(AttributeError):
        first.overloaded = True  # type: ignore[misc]
    nxt = first.next(overloaded=True)
    assert (nxt.generation, nxt.overloaded, nxt.table) == (first.generation + 1, True, first.table)
    pool.publish(nxt)
    assert pool.view is nxt and pool.overloaded and pool.table is first.table
    # A view built from an older one would undo what was published since: refused.
    with pytest.raises(ValueError, match="generation"):
        pool.publish(first.next(table=RoutingTable(version=9)))
    with pytest.raises(ValueError, match="generation"):
        pool.publish(View(first.table, False, nxt.generation))


def test_one_request_reads_one_view_even_if_another_is_published_meanwhile():
    a, b = _engine("a"), _engine("b")
    pool = _pool(a, b)
    pool.set_table(RoutingTable(version=1, weights={"x": {"a": 0.0, "b": 1.0}}))
    first = pool.view
    up = pool.health.up

    def up_and_publish(name: str) -> bool:
        # Control publishes a view that fills b while the order is being drawn.
        if pool.view is first:
            pool.publish(
                first.next(table=RoutingTable(version=2, weights=first.table.weights, limits={"b": 0}))
            )
        return up(name)

    pool.health.up = up_and_publish  # type: ignore[method-assign]
    # The order is drawn from the view read at its start: b by weight, then a.
    assert [e.name for e in pool.candidates("x")] == ["b", "a"]
    assert pool.view is not first and pool.limit("b") == 0
    # The next request reads the new view: b is full, a is tried first.
    assert [e.name for e in pool.candidates("x")] == ["a", "b"]
    # A view passed along is the one the claim reads its caps from.
    assert pool.acquire(b) is False
    assert [e.name for e in pool.candidates("x", first)] == ["b", "a"]


async def test_a_claim_reads_the_caps_of_the_view_it_was_given():
    a = _engine("a", max_in_flight=4)
    pool = _pool(a)
    first = pool.view
    pool.set_table(RoutingTable(version=1, weights=first.table.weights, limits={"a": 1}))
    held = await pool.claim([a])
    assert pool.limit("a") == 1 and not pool.acquire(a)
    lease = await pool.lease([a], "x", view=first)  # begun under the first view: cap 4
    assert lease is not None and pool.in_flight("a") == 2
    lease.settle(reported=False)
    pool.release(held)
    assert pool.in_flight("a") == 0


async def test_publishing_overload_lowers_caps_and_lifting_it_lets_waiters_in_with_no_call_into_slots():
    a = _engine("a", max_in_flight=4, max_in_flight_overloaded=2)
    pool = _pool(a)
    assert not hasattr(pool.slots, "set_overloaded")
    growers: list[asyncio.Task[object] | None] = []
    grow = pool.slots.grow

    def spy(name: str) -> None:
        growers.append(asyncio.current_task())
        grow(name)

    pool.slots.grow = spy  # type: ignore[method-assign]
    held = [await pool.claim([a]) for _ in range(2)]
    pool.publish(pool.view.next(overloaded=True))
    assert pool.limit("a") == 2 and not pool.acquire(a)
    blocked = asyncio.create_task(pool.claim([a]))
    await asyncio.sleep(0.01)
    assert not blocked.done() and pool.waiting("a") == 1
    me = asyncio.current_task()
    pool.publish(pool.view.next(overloaded=False))  # cap back to 4: the waiter lets itself in
    assert me not in growers  # publishing called nothing of the slots
    held.append(await asyncio.wait_for(blocked, 2))
    assert pool.in_flight("a") == 3 and pool.waiting("a") == 0
    assert growers and all(t is not me for t in growers)
    for e in held:
        pool.release(e)
    assert pool.in_flight("a") == 0


async def test_a_waiter_stays_queued_across_a_view_that_does_not_raise_its_cap():
    a = _engine("a", max_in_flight=1)
    pool = _pool(a)
    held = await pool.claim([a])
    blocked = asyncio.create_task(pool.claim([a]))
    await asyncio.sleep(0.01)
    pool.set_table(RoutingTable(version=5, weights=pool.table.weights))  # same cap
    await asyncio.sleep(0.01)
    assert not blocked.done() and pool.waiting("a") == 1
    pool.release(held)  # handed over in order, as ever
    got = await asyncio.wait_for(blocked, 2)
    assert got is a and pool.in_flight("a") == 1
    pool.release(got)


def test_transitions_go_to_subscribers_once_in_order_and_nothing_is_set_on_the_pool():
    a, b = _engine("a"), _engine("b")
    pool = _pool(a, b)
    assert not hasattr(pool, "transition_sink") and not hasattr(pool.health, "on_down")
    seen: list[Transition] = []
    unsubscribe = pool.transitions.subscribe(seen.append)
    for _ in range(5):
        pool.report_failure("a")
    pool.readmit("a")
    pool._set_health(b, False)
    assert [(t.action, t.engine) for t in seen] == [("eject", "a"), ("readmit", "a"), ("down", "b")]
    unsubscribe()
    pool._set_health(b, True)
    assert len(seen) == 3
