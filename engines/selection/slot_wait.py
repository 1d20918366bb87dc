"""The bounded FIFO wait for an engine slot, for engines/selection/slots.py's :class:`Slots`.

When every available engine for a request is at its cap, the request waits in a bounded queue per engine
(``max_waiting``, at most ``max_wait_s``); a freed slot is handed straight to the oldest waiter, so
newcomers cannot overtake, and a new view lets waiters in where the cap rose. A full queue or a wait that
runs out is :class:`core.errors.EngineBusy` (503 with ``Retry-After``). :class:`SlotWait` holds the
methods that run only then, over the counts and queues that :class:`Slots` keeps; it runs on the event
loop thread and needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from core.errors import EngineBusy
from engines.adapters.base import Engine
from engines.selection.health import Health
from engines.selection.view import View, Views
from observability.metrics import Metrics

__all__ = ["SlotWait"]

_BUSY_RETRY_AFTER_S = 1.0


class _Requeue(Exception):
    """A waiter woken without a slot: every engine it waited for became unavailable; look again."""


@dataclass(eq=False, slots=True)
class _Waiter:
    """One request waiting for a slot on any of ``engines``; the future resolves to the engine granted
    and the shared lease that comes with a slot handed over (None: the slot is new, or not shared)."""

    engines: tuple[str, ...]
    future: asyncio.Future[tuple[Engine, str | None]]


class SlotWait:
    """The wait for a slot; :class:`~engines.selection.slots.Slots` provides the state and the methods
    declared here."""

    in_flight: dict[str, int]
    _waiters: dict[str, deque[_Waiter]]
    _shared_busy: dict[str, float]
    _views: Views
    _metrics: Metrics
    _health: Health

    def limit(self, name: str, view: View | None = None) -> int | None:
        raise NotImplementedError

    def waiting(self, name: str) -> int:
        raise NotImplementedError

    def gauges(self, name: str) -> None:
        raise NotImplementedError

    def _queued(self, name: str) -> bool:
        raise NotImplementedError

    def _hand_over(self, name: str, lease: str | None = None) -> bool:
        raise NotImplementedError

    def release(self, engine: Engine | str, *, settled: bool = True, shared: str | None = None) -> None:
        raise NotImplementedError

    def _busy(self, model: str | None) -> EngineBusy:
        """A wait that ran out (here, or for the other replicas' slots): 503 engine_busy, counted as shed."""
        self._metrics.admission_shed.labels("engine_busy").inc()
        return EngineBusy(
            f"no engine for {model!r} had a free slot within the wait limit", retry_after=_BUSY_RETRY_AFTER_S
        )

    async def _wait(
        self, full: list[Engine], model: str | None, deadline: float
    ) -> tuple[Engine, str | None]:
        queues = [e for e in full if e.config.max_wait_s > 0 and self.waiting(e.name) < e.config.max_waiting]
        if not queues:
            self._metrics.admission_shed.labels("engine_busy").inc()
            raise EngineBusy(
                f"every engine for {model!r} is at its concurrency limit", retry_after=_BUSY_RETRY_AFTER_S
            )
        waiter = _Waiter(tuple(e.name for e in queues), asyncio.get_running_loop().create_future())
        for e in queues:
            self._waiters[e.name].append(waiter)
            self.gauges(e.name)
        t0 = time.perf_counter()
        # An engine passed over for being full on the other replicas is looked at again when that ends.
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        busy = [t for e in queues if (t := self._shared_busy.get(e.name, 0.0)) > now]
        recheck = min(busy) - now + loop.time() if busy else None
        until = deadline if recheck is None or recheck >= deadline else max(recheck, loop.time())
        try:
            async with asyncio.timeout_at(until):
                while not waiter.future.done():
                    woken = (waiter.future, self._views.published())
                    await asyncio.wait(woken, return_when=asyncio.FIRST_COMPLETED)
                    if not waiter.future.done():  # a new view: where the cap rose, waiters go in
                        for name in waiter.engines:
                            self.grow(name)
                granted = waiter.future.result()
        except BaseException as exc:  # cancellation included: a slot handed over meanwhile is passed on
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # A slot was handed over just as the wait ended: pass it on.
                engine, lease = waiter.future.result()
                self.release(engine, settled=False, shared=lease)
            else:
                waiter.future.cancel()
            if isinstance(exc, TimeoutError) and until < deadline:
                raise _Requeue() from None
            if isinstance(exc, TimeoutError):
                raise self._busy(model) from None
            raise
        finally:
            for e in queues:
                with contextlib.suppress(ValueError):
                    self._waiters[e.name].remove(waiter)
                self.gauges(e.name)
        self._metrics.engine_queue_wait.labels(granted[0].name).observe(time.perf_counter() - t0)
        return granted

    def grow(self, name: str) -> None:
        """The cap went up (or the engine came back): let waiters in while there is room."""
        limit = self.limit(name)
        while self._queued(name) and (limit is None or self.in_flight[name] < limit):
            self.in_flight[name] += 1
            if not self._hand_over(name):
                self.in_flight[name] -= 1
                break
        self.gauges(name)

    def strand_check(self, name: str) -> None:
        """``name`` became unavailable: waiters with no available engine left look again (last resort)."""
        for w in list(self._waiters[name]):
            if not w.future.done() and not any(self._health.up(n) for n in w.engines):
                w.future.set_exception(_Requeue())
