"""What runs inside a decoding worker process: its confinement, set once, and one task at a time.

A worker is forked from a server process that has already imported the decoders (so a replaced
worker starts in milliseconds), then confines itself before it takes a task, on the assumption that
a decoder parsing hostile bytes with a C library will one day run the attacker's code:

- a filesystem view of its own: a user and mount namespace whose root is an empty read-only tmpfs
  holding read-only bind mounts of the Python installation and the project's packages, and nothing
  else (no ``/proc``, no ``/dev/shm``, no data directory); where the kernel refuses namespaces, a
  Landlock ruleset allowing reads of the same directories and nothing else;
- a network namespace with nothing in it, where the kernel allows one;
- a seccomp allow-list of the system calls decoding needs (libseccomp): no ``execve``, ``ptrace``,
  ``mount``, ``unshare``, no socket but a Unix one, no new process, any other call fails with EPERM;
- no environment, and none of the gateway's keys in its memory to be read: the forkserver it is
  forked from starts with an allow-list of the gateway's variables (:data:`ENVIRONMENT`);
- no core dumps, no files written, an address-space cap above what the imports already mapped, a
  CPU-time limit reset for every task (the kernel kills a worker that spins past it).

A worker opens no file by name: a task's shared bytes are handed over as file descriptors the parent
opened (read-only where the worker only reads), fetched over the worker's Unix socket by a token that
only that task carries (:func:`_fetch_fd`). A wall-clock alarm per task turns a slow decode into an
error the parent maps to a 400; a decoder stuck where the alarm cannot reach it is killed by the
parent (policies/media/sandbox.py).
Its length: the confinement is applied in one order (filesystem view, environment, limits, seccomp
last) that each step depends on, so its steps are kept in the one module a reviewer reads whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from policies.media.shared import Handed, SharedOut

#: what the forkserver imports once, so every worker starts with the decoders loaded
PRELOAD = ["policies.media.worker", "policies.media.process"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_state: dict[str, Any] = {
    "cpu_s": 30.0,
    "network": "shared",
    "filesystem": "none",
    "syscalls": "none",
    "environment": "inherited",
    "channel": None,
    "fds": [],
}


class DeadlineExceeded(Exception):
    """The task ran past its wall-clock deadline inside the worker."""


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


# -- the filesystem view ----------------------------------------------------------------------------------
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 0x400, 0x800, 0x200000
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
#: the worker's working directory inside its own root: empty, and read-only like all of that root
_WORKDIR = "/decode"
_ROOT_AT = "/dev"


def exposed_dirs() -> list[str]:
    """The directories a worker may read: the Python installation's and the loaded packages'.

    The stdlib and site-packages whole; from any other import root (the project's checkout, the
    working directory) only its package directories, never the root itself, where configuration,
    keys and data may lie beside the code.
    """
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found: set[str] = set()
    roots: list[str] = []
    hidden = (_ROOT_AT, "/proc", "/sys")
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(path):
            continue
        if any(_under(path, p) for p in prefixes):
            found.add(path)
        else:
            roots.append(path)
    for root in roots:
        with contextlib.suppress(OSError):
            for item in os.scandir(root):
                if (
                    not item.name.startswith(".")
                    and item.is_dir()
                    and os.path.exists(os.path.join(item.path, "__init__.py"))
                ):
                    found.add(os.path.realpath(item.path))
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        name = getattr(module, "__name__", "")
        if not file or not name:
            continue
        top = sys.modules.get(name.partition(".")[0])
        paths = list(getattr(top, "__path__", None) or [])
        found.update(os.path.realpath(p) for p in paths if os.path.isdir(p))
    return _outermost(p for p in found if not any(_under(p, h) for h in hidden))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _outermost(paths: Iterable[str]) -> list[str]:
    out: list[str] = []
    for path in sorted(set(paths)):
        if path != "/" and not any(_under(path, kept) for kept in out):
            out.append(path)
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mount(
    libc: Any, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _locked_flags(path: str) -> int:
    """The flags a read-only remount of a bind of ``path`` must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    flags = _MS_NOSUID | _MS_NODEV
    for st, ms in (
        (os.ST_NOEXEC, _MS_NOEXEC),
        (os.ST_NOATIME, _MS_NOATIME),
        (os.ST_NODIRATIME, _MS_NODIRATIME),
        (os.ST_RELATIME, _MS_RELATIME),
    ):
        if f & st:
            flags |= ms
    return flags


def _mount_namespace(libc: Any, dirs: list[str]) -> bool:
    """Enter new user, mount and network namespaces whose root holds only ``dirs``, read-only."""
    import platform

    nr_pivot = _PIVOT_ROOT.get(platform.machine())
    if nr_pivot is None:
        return False
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET) != 0:
        return False
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
        # The new root is built on /dev, which in this namespace nobody needs and no exposed directory
        # lies under (a directory of its own would be left behind on the host, one per worker).
        new = _ROOT_AT
        _mount(libc, "omnigate-decode", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=0755")
        for d in dirs:
            target = new + d
            os.makedirs(target, exist_ok=True)
            _mount(libc, d, target, None, _MS_BIND | _MS_REC, None)
            _mount(libc, None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _locked_flags(d), None)
        os.makedirs(new + _WORKDIR, mode=0o555, exist_ok=True)
        _mount(libc, None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)
        # pivot_root(".", "."), then detach the old root stacked under the new one (pivot_root(2)).
        os.chdir(new)
        if libc.syscall(nr_pivot, b".", b".") != 0:
            raise OSError(ctypes.get_errno(), "pivot_root")
        if libc.umount2(b".", _MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), "umount2")
        os.chdir(_WORKDIR)
    except OSError as exc:
        # Half-made: the namespace is the worker's own, but its view is not what is promised. This
        # worker must not decode (set media.decode_filesystem to landlock where this kernel refuses it).
        with contextlib.suppress(OSError):
            os.write(2, f"omnigate decoding worker: its filesystem view failed: {exc}\n".encode())
        os._exit(71)
    return True


# -- Landlock, where namespaces are refused (containers commonly block unshare, not Landlock) -----------
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # the same on every architecture
_LL_VERSION = 1
_LL_RULE_PATH_BENEATH = 1
_LL_READ = 0x1 | 0x4 | 0x8  # execute, read file, read dir


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none."""
    try:
        libc = _libc()
        v = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_LL_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, int(v))


def _landlock(libc: Any, dirs: list[str]) -> bool:
    abi = landlock_abi()
    if abi < 1:
        return False
    fs = (1 << 13) - 1  # every access right of ABI 1
    if abi >= 2:
        fs |= 1 << 13  # refer
    if abi >= 3:
        fs |= 1 << 14  # truncate
    if abi >= 5:
        fs |= 1 << 15  # ioctl on devices
    # handled_access_fs, handled_access_net (ABI 4), scoped (ABI 6: abstract sockets and signals)
    attr = (ctypes.c_uint64 * 3)(fs, 0, 0x1 | 0x2 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        for d in dirs:
            fd = os.open(d, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(_LL_READ, fd)
                if libc.syscall(_LL_ADD_RULE, ruleset, _LL_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                    return False
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which restrict_self requires
            return False
        return bool(libc.syscall(_LL_RESTRICT, ruleset, 0) == 0)
    finally:
        os.close(ruleset)


# -- the seccomp allow-list -------------------------------------------------------------------------------
#: the system calls a decoding worker makes: CPython's runtime and imports, its pool's pipes, the fd
#: channel, threads, PyAV/FFmpeg, Pillow, libsndfile and numpy (derived by running the decoders under
#: the filter: tests/hardening/test_sandbox_confinement.py). Everything else fails with EPERM.
ALLOWED_SYSCALLS = (
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "membarrier",
    # files already open, and reads of the view
    "read", "readv", "pread64", "preadv", "preadv2", "write", "writev", "pwrite64", "pwritev",
    "close", "close_range", "fstat", "newfstatat", "statx", "stat", "lstat", "lseek",
    "openat", "open", "access", "faccessat", "faccessat2", "getdents64", "readlink", "readlinkat",
    "fcntl", "dup", "dup2", "dup3", "ioctl", "getcwd", "chdir", "fchdir", "fadvise64", "flock",
    "pipe", "pipe2", "ftruncate",
    # waiting, time, signals
    "poll", "ppoll", "select", "pselect6", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "futex", "futex_waitv", "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday",
    "time", "times", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
    "rt_sigtimedwait", "sigaltstack", "restart_syscall", "setitimer", "getitimer", "alarm", "pause",
    "eventfd2",
    # the process itself
    "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "getpgrp", "getpgid", "getsid", "getrlimit", "setrlimit", "prlimit64", "getrusage",
    "uname", "sysinfo", "getrandom", "sched_yield", "sched_getaffinity", "sched_getparam",
    "sched_getscheduler", "get_mempolicy", "set_robust_list", "get_robust_list", "set_tid_address",
    "rseq", "arch_prctl", "exit", "exit_group", "getcpu",
    # the pool's result pipe and the fd channel (Unix sockets only, see below)
    "socketpair", "getsockname", "getpeername", "sendmsg", "recvmsg", "sendto", "recvfrom", "shutdown", "getsockopt", "setsockopt",
)  # fmt: skip

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_EQ, _SCMP_CMP_MASKED_EQ = 4, 7
_SCMP_FLTATR_CTL_NNP = 3
_CLONE_THREAD = 0x00010000
_AF_UNIX = 1


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _libseccomp() -> Any:
    """libseccomp, loaded while the library search can still see the host (before the view is made)."""
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def _seccomp_allow_list(lib: Any) -> bool:
    """Load the allow-list into this thread (and the threads it starts later); False where it cannot."""
    if lib is None:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_act_errno(errno.EPERM))
    if not ctx:
        return False

    def rule(action: int, syscall: str, *cmps: tuple[int, int, int, int]) -> bool:
        nr = lib.seccomp_syscall_resolve_name(syscall.encode())
        if nr < 0:
            return True  # not a call of this architecture (e.g. open on aarch64)
        arr = (_ArgCmp * max(1, len(cmps)))(*(_ArgCmp(*c) for c in cmps))
        return bool(lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr) == 0)

    try:
        ok = all(rule(_SCMP_ACT_ALLOW, s) for s in ALLOWED_SYSCALLS)
        pid = os.getpid()
        ok = ok and rule(_SCMP_ACT_ALLOW, "socket", (0, _SCMP_CMP_EQ, _AF_UNIX, 0))
        # threads (FFmpeg's, OpenBLAS's, Python's) but never a new process: clone3 hides its flags
        # from the filter, so it is refused with ENOSYS, which makes the C library fall back to clone
        ok = ok and rule(_SCMP_ACT_ALLOW, "clone", (0, _SCMP_CMP_MASKED_EQ, _CLONE_THREAD, _CLONE_THREAD))
        ok = ok and rule(_act_errno(errno.ENOSYS), "clone3")
        # signals to itself only (abort(), the alarm), never to the gateway or another worker
        ok = ok and rule(_SCMP_ACT_ALLOW, "kill", (0, _SCMP_CMP_EQ, pid, 0))
        ok = ok and rule(_SCMP_ACT_ALLOW, "tgkill", (0, _SCMP_CMP_EQ, pid, 0))
        ok = ok and lib.seccomp_attr_set(ctypes.c_void_p(ctx), _SCMP_FLTATR_CTL_NNP, 1) == 0
        return bool(ok and lib.seccomp_load(ctx) == 0)
    finally:
        lib.seccomp_release(ctx)


#: what the forkserver, and so every worker, starts with of the gateway's environment: what the
#: interpreter, the C library and the decoders read (search and import paths, locale, time zone), never
#: a key. Variables named ``LC_*`` pass too.
ENVIRONMENT = (
    "PATH", "LD_LIBRARY_PATH", "TMPDIR", "LANG", "LANGUAGE", "TZ",
    "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX",
    "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONUNBUFFERED",
)  # fmt: skip
#: the decoders' thread pools, read when their libraries load in the forkserver: one thread, as a
#: worker decodes one part at a time (init_worker sets them again)
THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def passes(name: str) -> bool:
    """Whether a variable of the gateway's environment may reach the forkserver."""
    return name in ENVIRONMENT or name in THREADS or name.startswith("LC_")


def forkserver_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment the forkserver is started with: the allowed part of ``environ``, one thread each."""
    env = {k: v for k, v in environ.items() if passes(k) and k not in THREADS}
    return env | dict.fromkeys(THREADS, "1")


def _started_with() -> list[str]:
    """The names of the environment this process started with (as the forkserver was executed)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return list(os.environ)  # the same names, as the interpreter read them at its start
    return [e.partition(b"=")[0].decode("utf-8", "replace") for e in block.split(b"\0") if e]


def _scrub_environment() -> bool:
    """Forget the environment: the dict, the C library's array and the strings the process started
    with; whether that environment was a clean one (only what :func:`passes`).

    Scrubbing cannot forget every copy: the forkserver the worker was forked from read its environment
    into its heap, and those freed strings stay in the worker's memory. The forkserver is therefore
    started with a clean environment (policies/media/sandbox.py); a worker whose forkserver was not
    (someone else started it) says so, and the sandbox counts it as unconfined.
    """
    clean = all(passes(name) for name in _started_with())
    os.environ.clear()
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields 48 and 49 after the name: env_start and env_end (proc(5), counted from state = 3)
        start, end = int(fields[47]), int(fields[48])
        if 0 < start < end:
            ctypes.memset(start, 0, end - start)
    return clean


def init_worker(
    memory_mb: int,
    cpu_s: float,
    threads: int,
    gateway_pid: int | None = None,
    channel: socket.socket | None = None,
    filesystem: str = "auto",
) -> None:
    """The ProcessPoolExecutor initializer: confine this process before it decodes anything."""
    watch = _gateway_fd(gateway_pid) if gateway_pid is not None else None  # while its pid is visible
    for var in THREADS:
        os.environ[var] = str(threads)
    import policies.media.process  # noqa: F401 - already loaded from the forkserver; imported before the cap

    _state["cpu_s"] = cpu_s
    _state["channel"] = channel
    mapped = _address_space()
    _state["environment"] = "scrubbed" if _scrub_environment() else "inherited"
    libc = _libc()
    seccomp = _libseccomp()
    dirs = exposed_dirs()
    view = "none"
    # unshare(CLONE_NEWUSER) needs a process with one thread: before the watch thread starts
    if filesystem in ("auto", "mount-namespace") and _mount_namespace(libc, dirs):
        view = "mount-namespace"
        _state["network"] = "namespace"
    else:
        with contextlib.suppress(AttributeError):
            if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0 or libc.unshare(_CLONE_NEWNET) == 0:
                _state["network"] = "namespace"
        workdir = tempfile.mkdtemp(prefix="omnigate-decode-")
        os.chdir(workdir)
        os.chmod(workdir, 0o500)  # empty and not writable: a decoder finds no file to read, none to write
        if filesystem in ("auto", "landlock") and _landlock(libc, [*dirs, workdir]):
            view = "landlock"
    _state["filesystem"] = view
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    if memory_mb > 0 and mapped is not None:
        cap = mapped + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    signal.signal(signal.SIGALRM, _alarm)
    if _seccomp_allow_list(seccomp):
        _state["syscalls"] = "allow-list"
        _state["network"] = "seccomp+" + _state["network"] if _state["network"] != "shared" else "seccomp"
    if watch is not None:
        _end_with(watch)


def _gateway_fd(pid: int) -> int | None:
    """A pidfd of the gateway process that owns this worker's pool (None without pidfds)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (OSError, AttributeError):
        return None


def _end_with(fd: int) -> None:
    """End this worker when the gateway process that owns its pool ends, however it ends.

    The worker's parent is the forkserver, so no parent-death signal reaches it, and its pool's
    queues never see end-of-file (it holds their other ends too): a SIGKILLed gateway would leave
    its workers running and, through the pipe they hold open, its forkserver. A pidfd of the gateway
    becomes readable when it exits; one thread waits on it. Without pidfds (Linux before 5.3) the
    worker lives until its pool shuts it down, as before.
    """

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
        "filesystem": _state["filesystem"],
        "syscalls": _state["syscalls"],
        "environment": _state["environment"],
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "rlimit_cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
    }


def _fetch_fd(token: str) -> int:
    """The descriptor the parent holds for ``token``, over this worker's channel (each is handed once)."""
    channel = _state["channel"]
    if channel is None:
        raise RuntimeError("no descriptor channel to the gateway")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with mine:
        with theirs:
            socket.send_fds(channel, [token.encode("ascii")], [theirs.fileno()])
        _, fds, _, _ = socket.recv_fds(mine, 16, 1)
    if not fds:
        raise RuntimeError("the gateway handed no descriptor for this task")
    _state["fds"].append(fds[0])
    return fds[0]


def _resolve(arg: Any) -> Any:
    if not isinstance(arg, Handed):
        return arg
    fd = _fetch_fd(arg.token)
    if arg.writable:
        return SharedOut("", arg.size, fd)
    if arg.size == 0:
        return b""
    with mmap.mmap(fd, arg.size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        return m[: arg.size]


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
        fds, _state["fds"] = _state["fds"], []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
