"""What runs inside a decoding worker process: its confinement, set once, and one task at a time.

A worker is forked from a server process that has already imported the decoders (so a replaced
worker starts in milliseconds), then confines itself before it takes a task: an empty read-only
working directory, no core dumps, no files written, an address-space cap above what the imports
already mapped, a CPU-time limit reset for every task (the kernel kills a worker that spins past
it), a seccomp filter under which no socket but a Unix one can be created, and, where the kernel
allows it, a network namespace of its own. A wall-clock alarm per task turns a slow decode into an
error the parent maps to a 400; a decoder stuck where the alarm cannot reach it is killed by the
parent (policies/media/sandbox.py).
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

from policies.media.shared import SharedBytes, read_shared

#: what the forkserver imports once, so every worker starts with the decoders loaded
PRELOAD = ["policies.media.worker", "policies.media.process"]

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_state: dict[str, Any] = {"cpu_s": 30.0, "network": "shared"}


class DeadlineExceeded(Exception):
    """The task ran past its wall-clock deadline inside the worker."""


def _no_network() -> str:
    """Cut this process off the network; what was achieved, for the parent's log and tests.

    Two layers: a seccomp filter that fails every ``socket()`` call but for Unix sockets (unprivileged:
    it needs only ``no_new_privs``), and, where the kernel lets an unprivileged process have one, a
    network namespace of its own with nothing in it.
    """
    done = []
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return "shared"
    if _deny_sockets(libc):
        done.append("seccomp")
    try:
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0 or libc.unshare(_CLONE_NEWNET) == 0:
            done.append("namespace")
    except AttributeError:
        pass
    return "+".join(done) or "shared"


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


#: (audit arch, socket syscall number) of the architectures the filter knows (linux/audit.h, unistd.h)
_ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_EACCES = 0x7FFF0000, 0x00050000 | 13
_AF_UNIX = 1


def _deny_sockets(libc: Any) -> bool:
    """Install a seccomp filter: socket(family != AF_UNIX) fails with EACCES. False where it cannot."""
    import platform

    arch = _ARCHES.get(platform.machine())
    if arch is None:
        return False
    audit_arch, nr_socket = arch
    program = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, audit_arch),
        (_RET_K, 0, 0, _RET_ALLOW),  # another ABI (e.g. x32): left alone, the namespace still applies
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JEQ_K, 0, 3, nr_socket),
        (_LD_W_ABS, 0, 0, 16),  # args[0], the address family (low word)
        (_JEQ_K, 1, 0, _AF_UNIX),
        (_RET_K, 0, 0, _RET_EACCES),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
    prog = _SockFprog(len(program), filters)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        return False
    return bool(libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) == 0)


def init_worker(memory_mb: int, cpu_s: float, threads: int, gateway_pid: int | None = None) -> None:
    """The ProcessPoolExecutor initializer: confine this process before it decodes anything."""
    if gateway_pid is not None:
        _end_with(gateway_pid)  # first: before the address-space cap, and while its pid is still visible
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import policies.media.process  # noqa: F401 - already loaded from the forkserver; imported before the cap

    _state["cpu_s"] = cpu_s
    _state["network"] = _no_network()
    workdir = tempfile.mkdtemp(prefix="omnigate-decode-")
    os.chdir(workdir)
    os.chmod(workdir, 0o500)  # empty and not writable: a decoder finds no file to read, none to write
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    mapped = _address_space()
    if memory_mb > 0 and mapped is not None:
        cap = mapped + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGALRM, _alarm)


def _end_with(pid: int) -> None:
    """End this worker when the gateway process that owns its pool ends, however it ends.

    The worker's parent is the forkserver, so no parent-death signal reaches it, and its pool's
    queues never see end-of-file (it holds their other ends too): a SIGKILLed gateway would leave
    its workers running and, through the pipe they hold open, its forkserver. A pidfd of the gateway
    becomes readable when it exits; one thread waits on it. Without pidfds (Linux before 5.3) the
    worker lives until its pool shuts it down, as before.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (OSError, AttributeError):
        return

    def wait() -> None:
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=wait, name="omnigate-gateway-watch", daemon=True).start()


def _address_space() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _alarm(signum: int, frame: Any) -> None:
    raise DeadlineExceeded


def probe() -> dict[str, Any]:
    """The worker's confinement as it sees it (tests and the start-up log)."""
    return {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "cwd_entries": len(os.listdir(".")),
        "network": _state["network"],
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "rlimit_cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
    }


def _resolve(arg: Any) -> Any:
    return read_shared(arg) if isinstance(arg, SharedBytes) else arg


def run(fn: Callable[..., Any], args: tuple[Any, ...], deadline_s: float) -> tuple[str, Any]:
    """Run one task under a fresh CPU limit and a wall-clock alarm; errors come back as values.

    Exceptions do not pickle with their keyword fields (``param``), so a gateway error is sent back
    as its parts, and anything else as its class name only (the parent logs it, the client gets a
    generic message).
    """
    from core.errors import OmnigateError

    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft = int(used + _state["cpu_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    signal.setitimer(signal.ITIMER_REAL, deadline_s)
    try:
        return "ok", fn(*(_resolve(a) for a in args))
    except DeadlineExceeded:
        return "deadline", None
    except MemoryError:
        return "memory", None
    except OmnigateError as exc:
        return "error", (type(exc).__name__, exc.message, exc.param, exc.code)
    except Exception as exc:  # any decoder bug is this part's failure, reported by name
        return "crash", (type(exc).__name__, traceback.format_exc(limit=5))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
