"""The confined decoding workers' pool: its life, the descriptors handed to its workers, and a task's result.

:class:`WorkerPool` is a ``concurrent.futures.ProcessPoolExecutor`` (forkserver, ``max_tasks_per_child``,
an initializer that confines each worker: policies/media/worker.py) with a wall-clock deadline per
part. A worker that crashes, is killed by its CPU limit or hangs past the deadline costs the part it
was decoding a 400; the pool is replaced, and the other parts that were in flight in it are run once
more in the new one (the culprit breaks the second pool too and is refused then). The check of the
workers' confinement at start is :class:`policies.media.sandbox.Sandbox`'s.

None of it runs for a request without media parts: the workers start with the first part (or at
start-up, where a chain names media-limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import multiprocessing.util as mp_util
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import Any

import structlog

from core import errors, spooled
from core.errors import GuardUnavailable, InvalidMedia
from observability.trace_spans import step
from policies.media import shared, worker
from policies.settings import MediaSettings

log = structlog.get_logger(__name__)

#: what the parent waits beyond the worker's own alarm before it kills the worker
_GRACE_S = 2.0
#: bytes arguments from this size cross to the worker through shared memory (see _share)
SHARE_MIN = 1 << 20


class DecoderFailed(InvalidMedia):
    """The worker decoding the part died or hung; the client is told no more than that."""


class Unconfined(RuntimeError):
    """The decoding workers could not be confined as ``media.decode_confinement`` requires."""


class WorkerPool:
    """The decoding workers' pool; :class:`policies.media.sandbox.Sandbox` starts it and checks its confinement."""

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
        return _Executor(
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
        """Start the workers and check their confinement (:class:`policies.media.sandbox.Sandbox`)."""
        raise NotImplementedError

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
        started, error = time.perf_counter(), None
        try:
            return await self._run(fn, args, param, tokens)
        except Exception as exc:
            error = exc
            raise
        finally:
            # A traced request's span of it (nothing when tracing is off): which part, how long, whether it failed.
            step(
                "media decode",
                time.perf_counter() - started,
                {"omnigate.media.part": param, "omnigate.media.task": fn.__name__},
                error,
            )
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


class _Executor(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` that replaces every worker that exits at ``max_tasks_per_child``.

    CPython's (from 3.11 until the fix of https://github.com/python/cpython/issues/115634) replaces an exited worker
    only where its idle-worker semaphore is empty; but that semaphore counts finished tasks, not idle
    workers, and while tasks are queued (many parts decoded at once) it keeps tokens of workers that
    have since exited. The replacement is then skipped, and once every worker has exited so, the queued
    parts wait for a worker that never comes, until the parent's deadline calls them hung.
    """

    def __init__(self, max_workers: int, **kwargs: Any) -> None:
        super().__init__(max_workers, **kwargs)
        self._size = max_workers

    def _adjust_process_count(self) -> None:
        # Called, under the shutdown lock, by submit() and by the manager thread after a worker exited:
        # the pool is kept at its size, whatever the semaphore says (None once it is shut down).
        processes = self._processes
        while processes is not None and len(processes) < self._size:
            # _spawn_process is private to CPython's executor and absent from its type stubs: ignored for that.
            self._spawn_process()  # type: ignore[attr-defined]


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
