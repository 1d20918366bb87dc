"""Decoding in confined worker processes, and the byte budgets media holds while a request runs.

:class:`Sandbox` is a ``concurrent.futures.ProcessPoolExecutor`` (forkserver, ``max_tasks_per_child``,
an initializer that confines each worker: policies/media/worker.py) with a wall-clock deadline per
part. A worker that crashes, is killed by its CPU limit or hangs past the deadline costs the part it
was decoding a 400; the pool is replaced, and the other parts that were in flight in it are run once
more in the new one (the culprit breaks the second pool too and is refused then).

:class:`ByteBudget` is the process-wide budget on media bytes in flight (an async semaphore counted in
bytes); :class:`RequestBudget` one request's share of it, taken as parts stream in, given back when
the request ends.

Its length: the pool's life (start, confinement check, replacement after a crash, the descriptors
handed to its workers) and the byte budgets the parts hold while they are decoded meet at every
part, so they are kept together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.util as mp_util
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import structlog

from core import errors, spooled
from core.errors import GuardUnavailable, InvalidMedia, MediaTooLarge, Overloaded
from policies.media import shared, worker
from policies.media.parts import MediaRef, decode_payload_into
from policies.settings import MediaSettings

if TYPE_CHECKING:
    from policies.base import Deps

log = structlog.get_logger(__name__)

#: what the parent waits beyond the worker's own alarm before it kills the worker
_GRACE_S = 2.0
#: bytes arguments from this size cross to the worker through shared memory (see _share)
SHARE_MIN = 1 << 20


class DecoderFailed(InvalidMedia):
    """The worker decoding the part died or hung; the client is told no more than that."""


class Unconfined(RuntimeError):
    """The decoding workers could not be confined as ``media.decode_confinement`` requires."""


class Sandbox:
    def __init__(self, cfg: MediaSettings) -> None:
        self.cfg = cfg
        self._pool: ProcessPoolExecutor | None = None
        self._fds: FdServer | None = None
        self._generation = 0
        self.replaced = 0  # pools replaced after a crash or hang (tests, metrics)
        #: the workers' confinement as they reported it at start (None until then): the start-up
        #: log, the admin health view and the tests read it
        self.confinement: dict[str, str] | None = None
        self._starting = asyncio.Lock()
        self._refused: str | None = None  # why a lazy start found the confinement short of required

    def _new_pool(self) -> ProcessPoolExecutor:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_preload())
        start_forkserver()
        if self._fds is None:
            self._fds = FdServer()
        return ProcessPoolExecutor(
            self.cfg.decode_workers,
            mp_context=ctx,
            initializer=worker.init_worker,
            initargs=(
                self.cfg.decode_memory_mb,
                self.cfg.decode_cpu_s,
                1,
                os.getpid(),
                self._fds.worker_end,
                self.cfg.decode_filesystem,
            ),
            max_tasks_per_child=self.cfg.decode_tasks_per_child,
        )

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

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            _kill(pool)
        if self._fds is not None:
            fds, self._fds = self._fds, None
            fds.close()

    async def probe_worker(self) -> dict[str, Any]:
        """One worker's view of its confinement."""
        seen: dict[str, Any] = await self.run(worker.probe, (), param="")
        return seen

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], *, param: str) -> Any:
        """``fn(*args)`` in a worker: its result, the gateway error it raised, or a generic 400."""
        args, segments = _share(args)
        tokens: list[str] = []
        try:
            return await self._run(fn, args, param, tokens)
        finally:
            if tokens and self._fds is not None:
                self._fds.forget(tokens)
            for shm in segments:
                shm.close()
                shm.unlink()

    async def _confined(self) -> None:
        """Start the workers (and check their confinement) before the first task of a lazy sandbox."""
        if self.confinement is not None:
            return
        async with self._starting:
            if self.confinement is None and self._refused is None:
                try:
                    await self.start()
                except Unconfined as exc:
                    log.error("media_sandbox_refused", reason=str(exc))
                    self._refused = str(exc)
        if self._refused is not None:
            # Never decoded unconfined: the part is refused as a guard that cannot run (the reason is logged).
            raise GuardUnavailable("media decoding is unavailable on this gateway")

    async def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], param: str, tokens: list[str]) -> Any:
        await self._confined()
        for attempt in (1, 2):
            if self._pool is None:
                self._pool = self._new_pool()
            pool, generation = self._pool, self._generation
            assert self._fds is not None
            # Fresh tokens per attempt: a descriptor is handed once, to the worker that took the task.
            handed = tuple(self._fds.hand(a, tokens) for a in args)
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(pool, worker.run, fn, handed, self.cfg.decode_deadline_s)
            try:
                status, value = await asyncio.wait_for(future, self.cfg.decode_deadline_s + _GRACE_S)
            except TimeoutError:
                # Stuck where its own alarm cannot reach (inside a C call): only killing it ends it.
                log.warning("media_decoder_hung", param=param, deadline_s=self.cfg.decode_deadline_s)
                self._replace(generation)
                raise _too_slow(param) from None
            except BrokenProcessPool:
                log.warning("media_decoder_died", param=param, attempt=attempt)
                self._replace(generation)
                if attempt == 1:
                    continue  # perhaps another part's worker died: this one gets one more try
                raise DecoderFailed(f"{param}: the media could not be decoded", param=param or None) from None
            return _result(status, value, param)
        raise AssertionError("unreachable")

    def _replace(self, generation: int) -> None:
        if generation != self._generation or self._pool is None:
            return  # another task already replaced this pool
        old, self._pool = self._pool, self._new_pool()
        self._generation += 1
        self.replaced += 1
        _kill(old)


class FdServer:
    """Hands a task's shared files to the worker that took it, as descriptors, never as names.

    Each pool's workers inherit one end of a Unix socket pair. A worker that needs a task's file sends
    the task's token with a fresh socket of its own (SCM_RIGHTS); a thread here answers on that socket
    with the descriptor the token stands for, opened by the gateway (read-only for an argument), and
    forgets the token. A token is a secret only its task's arguments carry, good for one fetch.
    """

    def __init__(self) -> None:
        self._mine, self.worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._thread = threading.Thread(target=self._serve, name="omnigate-decode-fds", daemon=True)
        self._thread.start()

    def hand(self, arg: Any, tokens: list[str]) -> Any:
        """``arg`` as a worker receives it: a shared file's token in its place (``tokens`` gets it)."""
        if isinstance(arg, shared.SharedBytes):
            flags, size, writable = os.O_RDONLY, arg.size, False
        elif isinstance(arg, shared.SharedOut):
            flags, size, writable = os.O_RDWR, arg.size, True
        else:
            return arg
        name = arg.name
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"not a shared-memory file's name: {name!r}")
        fd = os.open(os.path.join(spooled.SHM_DIR, name), flags | os.O_CLOEXEC | os.O_NOFOLLOW)
        token = secrets.token_hex(16)
        with self._lock:
            self._pending[token] = fd
        tokens.append(token)
        return shared.Handed(token, size, writable)

    def forget(self, tokens: list[str]) -> None:
        with self._lock:
            fds = [self._pending.pop(t) for t in tokens if t in self._pending]
        for fd in fds:
            os.close(fd)

    def _serve(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._mine, 64, 1)
            except OSError:
                return
            if not msg and not fds:
                return  # shut down
            for reply in fds[:1]:
                with self._lock:
                    fd = self._pending.pop(msg.decode("ascii", "replace"), None)
                try:
                    with socket.socket(fileno=reply) as out:
                        socket.send_fds(
                            out, [b"1" if fd is not None else b"0"], [fd] if fd is not None else []
                        )
                except OSError:
                    pass
                finally:
                    if fd is not None:
                        os.close(fd)
            for extra in fds[1:]:
                os.close(extra)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._mine.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._mine.close()
        self.worker_end.close()
        self.forget(list(self._pending))


def missing_confinement(seen: list[dict[str, Any]]) -> list[str]:
    """What a worker's probe shows it lacks of the confinement the sandbox promises."""
    missing: set[str] = set()
    for s in seen:
        if s.get("filesystem") not in ("mount-namespace", "landlock"):
            missing.add("filesystem view")
        if s.get("syscalls") != "allow-list":
            missing.add("seccomp allow-list")
        if s.get("environment") != "scrubbed":
            missing.add("environment")
    return sorted(missing)


_PR_SET_DUMPABLE = 4


def not_dumpable() -> bool:
    """Make this process non-dumpable; whether it could.

    Its ``/proc/<pid>/environ``, ``mem`` and the rest then belong to root, and no process of the same
    user may ptrace it: a decoder that escaped its worker (or any other process of the gateway's
    user) cannot read the admin key out of the gateway.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _share(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[shared_memory.SharedMemory]]:
    """Large bytes arguments moved to shared-memory segments the caller unlinks after the task.

    Pickled through the pool's call queue, a part would be copied into a pickle that the queue's
    feeder thread keeps referenced until the next task is sent: another copy of the part held while
    its request goes on to the engine. A segment is one copy, given back when the task returns. Where
    no segment can be had (``/dev/shm`` full or missing), the bytes are pickled as before.
    """
    out: list[Any] = []
    segments: list[shared_memory.SharedMemory] = []
    for arg in args:
        if isinstance(arg, bytes) and len(arg) >= SHARE_MIN:
            shm = _segment(len(arg))
            if shm is not None:
                shared.mapped(shm)[: len(arg)] = arg
                segments.append(shm)
                out.append(shared.SharedBytes(shm.name, len(arg)))
                continue
        out.append(arg)
    return tuple(out), segments


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


def _segment(size: int) -> shared_memory.SharedMemory | None:
    # Named like the spool's files (the owner's pid, a shared lock held while open): what a killed
    # gateway left behind, the next start sweeps (core/spooled.py).
    name = f"{spooled.PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    except OSError:
        return None
    try:
        spooled.hold(shm._fd)  # type: ignore[attr-defined]
        # Reserve the pages now: on a full tmpfs the copy into the mapping would be a SIGBUS, not an error.
        os.posix_fallocate(shm._fd, 0, size)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        shm.close()
        shm.unlink()
        return None
    return shm


#: the interpreter started first, with the gateway's environment, only to execute the forkserver's
#: with a clean one: ``python -P -S -c _EXEC <n> <n NAME=VALUE> <the forkserver's command line>``
#: (``-S``: nothing of the installation's site; ``os`` and ``sys`` are built in, found before any path)
_EXEC = (
    "import os, sys; n = int(sys.argv[1]); "
    "os.execve(sys.argv[n + 2], sys.argv[n + 2 :], dict(a.split('=', 1) for a in sys.argv[2 : n + 2]))"
)
_STARTING = threading.Lock()


def start_forkserver() -> None:
    """Start multiprocessing's forkserver, where it is not running, with a clean environment.

    Every worker is forked from it, so whatever its environment held is in every worker's memory:
    clearing the worker's environment forgets the variables, not the copies the forkserver's
    interpreter made of them when it started. The forkserver's command line is therefore executed
    through one more interpreter that replaces itself with the forkserver (``execve``), passing on
    only what :func:`worker.forkserver_environment` allows: the forkserver's initial environment
    block and heap never held the gateway's keys. multiprocessing starts it with
    ``util.spawnv_passfds``, which is replaced for that one call, under a lock (a process that other
    code starts at the same moment gets the clean environment too). Each worker checks the
    environment its forkserver started with, so a forkserver started some other way shows as an
    unconfined worker (``environment: inherited``).
    """
    with _STARTING:
        spawnv = mp_util.spawnv_passfds

        def clean(path: bytes, args: Sequence[Any], passfds: Sequence[int]) -> int:
            env = [f"{k}={v}" for k, v in worker.forkserver_environment(dict(os.environ)).items()]
            launch = [path, "-P", "-S", "-c", _EXEC, str(len(env)), *env, path, *args[1:]]
            return spawnv(path, launch, passfds)

        mp_util.spawnv_passfds = clean
        try:
            mp_forkserver.ensure_running()
        finally:
            mp_util.spawnv_passfds = spawnv


def _preload() -> list[str]:
    """The decoders, and the parent's main module: each forked worker re-runs ``__main__`` (multiprocessing
    prepares every child that way), which costs nothing when the forkserver already imported it."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    extra = [name] if name and not name.endswith("__main__") else []
    return [*worker.PRELOAD, *extra, "__main__"]


def _kill(pool: ProcessPoolExecutor) -> None:
    # Python 3.14 adds ProcessPoolExecutor.terminate_workers(); until then its process map is the
    # only handle on the workers, and a hung decoder ignores the polite shutdown.
    processes = dict(getattr(pool, "_processes", None) or {})
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes.values():
        with contextlib.suppress(OSError, AttributeError):
            proc.kill()


def _too_slow(param: str) -> DecoderFailed:
    return DecoderFailed(f"{param}: the media took too long to decode", param=param or None)


def _result(status: str, value: Any, param: str) -> Any:
    if status == "ok":
        return value
    if status == "deadline":
        log.info("media_decode_deadline", param=param)
        raise _too_slow(param)
    if status == "memory":
        log.info("media_decode_memory", param=param)
        raise DecoderFailed(f"{param}: the media needs too much memory to decode", param=param or None)
    if status == "error":
        name, message, p, code = value
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.OmnigateError)):
            cls = InvalidMedia
        exc = cls(message, param=p)
        if code is not None:
            exc.code = code
        raise exc
    name, trace = value
    log.warning("media_decoder_error", param=param, error=name, trace=trace)
    raise DecoderFailed(f"{param}: the media could not be decoded", param=param or None)


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


#: allocations at least this large get pages of their own, given back to the system when freed
LARGE_BUFFER = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def large_buffers_to_the_system() -> bool:
    """Fix glibc's mmap threshold at :data:`LARGE_BUFFER` for this process; whether it could.

    glibc raises the threshold to the size of each mmapped block freed (up to 32 MiB), so after the
    first large request, bodies, base64 strings and decoded parts come from the heap, where a freed
    one stays resident and a growing one is copied: a request's peak RSS would then be set by the
    requests before it. A fixed threshold keeps each media buffer in pages of its own, returned on
    free. Not glibc (musl, macOS): nothing to do.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_BUFFER))
    except (OSError, AttributeError):
        return False


def runtime_of(deps: Deps) -> MediaRuntime | None:
    """The gateway's media runtime among ``deps``' resources; None outside a gateway."""
    found = deps.resources.get("media")
    if found is None or isinstance(found, MediaRuntime):
        return found
    raise TypeError(f"the media resource is a {type(found).__name__}, not a MediaRuntime")
