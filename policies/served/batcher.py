"""Micro-batching of concurrent requests to a served guard model: one engine call per batch window.

A job (one request's items: pairs to score, texts to classify) opens a window when none is open; the
window closes after ``max_wait_s`` or as soon as it holds ``max_batch`` items, and its jobs go to the
engine as one call. Each job waits at most ``deadline_s`` from its submission, whatever it waits on (the
window, a free call slot, the engine): past it the caller gets :class:`core.errors.GuardUnavailable`, so
the policy's ``on_error`` applies. A caller cancelled (its client gone) or timed out while its job is
still in an open window takes its items out of it: they are not sent. At most ``max_inflight`` calls are
in flight at once; the windows that close meanwhile wait for a slot, each job still under its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from core.errors import GuardUnavailable

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False, slots=True)
class _Job(Generic[T, R]):
    items: list[T]
    future: asyncio.Future[list[R]]


@dataclass(slots=True)
class BatchStats:
    """What the batcher sent: engine calls, the items in them, and the largest batch."""

    calls: int = 0
    items: int = 0
    largest: int = 0
    failures: int = 0
    sizes: list[int] = field(default_factory=list)

    def record(self, n: int) -> None:
        self.calls += 1
        self.items += n
        self.largest = max(self.largest, n)
        if len(self.sizes) < 4096:  # the recent history is for tests and benchmarks; bounded
            self.sizes.append(n)


class MicroBatcher(Generic[T, R]):
    """Gathers the items of concurrent jobs into calls of ``call`` (a list in, one result per item out)."""

    def __init__(
        self,
        call: Callable[[list[T]], Awaitable[list[R]]],
        *,
        max_batch: int,
        max_wait_s: float,
        deadline_s: float,
        max_inflight: int = 4,
        name: str = "served-guard",
    ) -> None:
        if max_batch < 1 or max_inflight < 1:
            raise ValueError("max_batch and max_inflight must be at least 1")
        self._call = call
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._deadline_s = deadline_s
        self._slots = asyncio.Semaphore(max_inflight)
        self._name = name
        self._pending: list[_Job[T, R]] = []
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.stats = BatchStats()

    @property
    def waiting(self) -> int:
        """Items in the open window (not sent yet)."""
        return self._count

    async def submit(self, items: Sequence[T]) -> list[R]:
        """The results for ``items``, in order, once the window they joined was sent and answered."""
        if not items:
            return []
        if self._closed:
            raise GuardUnavailable(f"the {self._name} model client is closed")
        loop = asyncio.get_running_loop()
        job: _Job[T, R] = _Job(list(items), loop.create_future())
        self._pending.append(job)
        self._count += len(job.items)
        if self._count >= self._max_batch:
            self._close_window()
        elif self._timer is None:
            self._timer = loop.call_later(self._max_wait_s, self._close_window)
        try:
            async with asyncio.timeout(self._deadline_s):
                return await job.future
        except TimeoutError as exc:
            raise GuardUnavailable(
                f"the {self._name} model did not answer within {self._deadline_s:g} s"
            ) from exc
        finally:
            self._withdraw(job)

    def _withdraw(self, job: _Job[T, R]) -> None:
        """A job that left before its window closed (cancelled, timed out) gives its place back."""
        if not job.future.done():
            job.future.cancel()
        if job in self._pending:
            self._pending.remove(job)
            self._count -= len(job.items)
            if not self._pending and self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _close_window(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch: list[_Job[T, R]] = []
            n = 0
            # The window's jobs in arrival order, up to max_batch items (a larger job goes alone).
            while self._pending and (not batch or n + len(self._pending[0].items) <= self._max_batch):
                job = self._pending.pop(0)
                batch.append(job)
                n += len(job.items)
            self._count -= n
            task = asyncio.get_running_loop().create_task(self._send(batch), name=self._name)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if self._count < self._max_batch:
                break
        if self._pending and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._max_wait_s, self._close_window)

    async def _send(self, batch: list[_Job[T, R]]) -> None:
        async with self._slots:
            live = [j for j in batch if not j.future.done()]  # a caller gone while it waited for a slot
            if not live:
                return
            items = [item for j in live for item in j.items]
            self.stats.record(len(items))
            try:
                results = await self._call(items)
                if len(results) != len(items):
                    raise GuardUnavailable(
                        f"the {self._name} model answered {len(results)} results for {len(items)} inputs"
                    )
            except Exception as exc:  # every waiting caller learns it; the policy's on_error decides
                self.stats.failures += 1
                message = (
                    exc.message if isinstance(exc, GuardUnavailable) else f"the {self._name} model failed"
                )
                for j in live:
                    if not j.future.done():
                        # One error per caller: each raises it in its own task, with its own traceback.
                        error = GuardUnavailable(message)
                        error.__cause__ = exc
                        j.future.set_exception(error)
                return
        i = 0
        for j in live:
            part, i = results[i : i + len(j.items)], i + len(j.items)
            if not j.future.done():
                j.future.set_result(part)

    async def aclose(self) -> None:
        """Refuse new jobs, fail the waiting ones, and wait for the calls in flight to end."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(GuardUnavailable(f"the {self._name} model client is closed"))
        self._pending.clear()
        self._count = 0
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
