"""Decoding in confined worker processes, and the byte budgets media holds while a request runs.

:class:`Sandbox` is the pool of confined decoding workers: policies/media/decode_pool.py holds the
pool's life (its processes, replacement after a crash, the descriptors handed to its workers, a task's
result); what is here is its start, which checks the workers' confinement.

:class:`ByteBudget` is the process-wide budget on media bytes in flight (an async semaphore counted in
bytes); :class:`RequestBudget` one request's share of it, taken as parts stream in, given back when
the request ends.
"""

from __future__ import annotations

import asyncio
import collections
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import structlog

from core import spooled
from core.errors import MediaTooLarge, Overloaded
from policies.media import shared, worker
from policies.media.decode_pool import SHARE_MIN as SHARE_MIN
from policies.media.decode_pool import DecoderFailed as DecoderFailed
from policies.media.decode_pool import FdServer as FdServer
from policies.media.decode_pool import Unconfined as Unconfined
from policies.media.decode_pool import WorkerPool, _segment
from policies.media.decode_pool import missing_confinement as missing_confinement
from policies.media.decode_pool import start_forkserver as start_forkserver
from policies.media.parts import MediaRef, decode_payload_into
from policies.media.process_setup import LARGE_BUFFER as LARGE_BUFFER
from policies.media.process_setup import large_buffers_to_the_system as large_buffers_to_the_system
from policies.media.process_setup import not_dumpable as not_dumpable
from policies.settings import MediaSettings

if TYPE_CHECKING:
    from policies.base import Deps

log = structlog.get_logger(__name__)


class Sandbox(WorkerPool):
    """The confined decoding workers; :meth:`start` checks their confinement.

    The check (``missing_confinement``) is looked up in this module, as :func:`shared_part`'s
    ``_segment`` is: what replaces them here (the hardening tests) is what runs.
    """

    async def start(self) -> None:
        """Start the workers now, so the first request does not pay for them; log their confinement.

        Where the confinement is short of what ``media.decode_confinement`` requires, the workers are
        stopped and :class:`Unconfined` raised (the gateway does not start), or, set to ``warn``, it
        is logged as an error and the gateway goes on.
        """
        if self._pool is None:
            self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        seen = await asyncio.gather(
            *(loop.run_in_executor(self._pool, worker.probe) for _ in range(self.cfg.decode_workers))
        )
        self.confinement = {
            key: "|".join(sorted({str(s[key]) for s in seen}))
            for key in ("filesystem", "syscalls", "network", "environment")
        }
        log.info(
            "media_sandbox_started",
            workers=self.cfg.decode_workers,
            **self.confinement,
            memory_mb=self.cfg.decode_memory_mb,
            cpu_s=self.cfg.decode_cpu_s,
            deadline_s=self.cfg.decode_deadline_s,
        )
        missing = missing_confinement(seen)
        if missing:
            if self.cfg.decode_confinement == "require":
                await self.aclose()
                raise Unconfined(
                    f"the decoding workers could not be confined ({', '.join(missing)}); this kernel "
                    "refuses what media.decode_confinement 'require' needs (set it to 'warn' to run so)"
                )
            log.error("media_sandbox_unconfined", missing=missing)


class SharedPart:
    """A part's decoded bytes in a shared-memory segment that workers read; its owner releases it."""

    def __init__(self, shm: shared_memory.SharedMemory, size: int) -> None:
        self._shm = shm
        self.handle = shared.SharedBytes(shm.name, size)

    def view(self) -> memoryview:
        """The bytes in place (use as a context manager: a view left open keeps the segment mapped)."""
        return shared.mapped(self._shm)[: self.handle.size]

    def release(self) -> None:
        self._shm.close()
        self._shm.unlink()


def shared_part(ref: MediaRef, size: int) -> SharedPart | None:
    """The part decoded straight into a new segment of ``size`` bytes; None where none can be had.

    The gateway then holds the part once, in the segment, for every task on it (probe, decode), and
    never as bytes beside it. Malformed base64 is the same 400 as :func:`decode_payload`'s.
    """
    shm = _segment(size) if size > 0 else None
    if shm is None:
        return None
    try:
        decode_payload_into(ref, shared.mapped(shm))
    except Exception:
        shm.close()
        shm.unlink()
        raise
    return SharedPart(shm, size)


class ByteBudget:
    """Media bytes the whole process may hold at once; waiters are served in arrival order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def take(self, n: int, wait_s: float) -> None:
        if not self._waiters and self.used + n <= self.limit:
            self.used += n
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(wait_s):
                await waiter
        except BaseException as exc:  # timed out or cancelled: never keep, or lose, a grant
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # those queued behind may fit now
            elif waiter.done() and not waiter.cancelled():
                self.give(n)  # granted in the same tick as the give-up
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    "the gateway is holding as much media as it may; retry shortly", retry_after=1
                ) from None
            raise

    def take_now(self, n: int) -> None:
        """Count ``n`` bytes now or refuse them (503): for bytes that are arriving and cannot wait."""
        if self._waiters or self.used + n > self.limit:
            raise Overloaded("the gateway is holding as much media as it may; retry shortly", retry_after=1)
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            n, waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += n
                waiter.set_result(None)


class RequestBudget:
    """One request's media bytes: capped per request, and drawn from the process-wide budget.

    Its body's spooled payloads are counted here too, as they are written (:meth:`charge`, for
    core/spooled.py's writer): against the process's budget only, a 503 past it while the body
    arrives (a body cannot wait for room: its bytes are already coming); the request's own limit is
    the media steps', which name the part that crosses it. When a media step then counts a part
    (:meth:`take`), bytes the spool already counted cover it, so no byte is counted twice. Everything
    is given back when the request ends (:meth:`release`, on the request's holdings), or a file's
    uncovered share when that file goes first.
    """

    def __init__(self, shared: ByteBudget, limit: int, wait_s: float) -> None:
        self._shared = shared
        self.limit = limit
        self._wait_s = wait_s
        self.held = 0
        #: bytes the spool counted that no media step has claimed yet
        self.spooled = 0

    @property
    def room(self) -> int:
        return self.limit - self.held

    async def take(self, n: int, param: str) -> None:
        """Count ``n`` more bytes for the part at ``param``: 413 naming it when the request is over."""
        if self.held + n > self.limit:
            raise MediaTooLarge(f"{param}: the request's media exceeds {self.limit:,} bytes", param=param)
        covered = min(n, self.spooled)
        self.spooled -= covered
        try:
            if n > covered:
                await self._shared.take(n - covered, self._wait_s)
        except BaseException:
            self.spooled += covered
            raise
        self.held += n

    def charge(self, n: int) -> None:
        """Count ``n`` bytes a spool file is about to take, now, or refuse them (503)."""
        self._shared.take_now(n)
        self.spooled += n

    def refund(self, n: int) -> None:
        """A spool file gave back ``n`` bytes: those no media step claimed (nothing after the release)."""
        n = min(n, self.spooled)
        self.spooled -= n
        if n:
            self._shared.give(n)

    def release(self) -> None:
        held, self.held = self.held + self.spooled, 0
        self.spooled = 0
        if held:
            self._shared.give(held)


class MediaRuntime:
    """The process's media resources, owned by the lifespan: the sandbox and the byte budget."""

    def __init__(self, cfg: MediaSettings, eager: bool = False) -> None:
        self.cfg = cfg
        #: start the workers and load the decoders at start-up (a chain names media-limits); otherwise
        #: both wait for the first media part, so a text-only gateway never pays for them
        self.eager = eager
        self.sandbox = Sandbox(cfg)
        self.inflight = ByteBudget(cfg.max_inflight_bytes)

    def request_budget(self) -> RequestBudget:
        return RequestBudget(self.inflight, self.cfg.max_request_bytes, self.cfg.inflight_wait_s)

    async def start(self) -> None:
        large_buffers_to_the_system()
        swept = spooled.sweep()
        if swept:
            log.info("media_spool_swept", files=len(swept))
        if not not_dumpable():
            log.warning("gateway_dumpable", reason="prctl(PR_SET_DUMPABLE, 0) failed")
        if self.eager:
            await self.sandbox.start()

    async def aclose(self) -> None:
        await self.sandbox.aclose()


def runtime_of(deps: Deps) -> MediaRuntime | None:
    """The gateway's media runtime among ``deps``' resources; None outside a gateway."""
    found = deps.resources.get("media")
    if found is None or isinstance(found, MediaRuntime):
        return found
    raise TypeError(f"the media resource is a {type(found).__name__}, not a MediaRuntime")
