"""Decoders that misbehave on purpose, importable by a decoding worker process (tests only)."""

from __future__ import annotations

import os
import signal
import time


def sleeps(*_args: object) -> None:
    """Hangs in a way the worker's own alarm interrupts."""
    time.sleep(600)


def hangs_in_c(*_args: object) -> None:
    """Hangs where the worker's alarm cannot reach, as a decoder stuck inside a C call does."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)


def spins(*_args: object) -> None:
    """Burns CPU until the kernel's CPU-time limit kills the worker."""
    while True:
        pass


def crashes(*_args: object) -> None:
    os.abort()


def allocates(*_args: object) -> bytes:
    """Asks for more memory than the worker's address-space cap."""
    return b"\0" * (64 * 1024**3)


def reads_cwd(*_args: object) -> list[str]:
    return os.listdir(".")


def connects(port: int) -> str:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError as exc:
        return type(exc).__name__
    return "connected"


def _outcome(step) -> str:
    """'allowed', or the errno name the attempt failed with."""
    import errno as errnos

    try:
        step()
    except OSError as exc:
        return errnos.errorcode.get(exc.errno or 0, type(exc).__name__)
    return "allowed"


def escapes(
    gateway_pid: int, spool_name: str, audit_db: str, other_path: str, *_parts: object
) -> dict[str, str]:
    """What a decoder that runs the attacker's code would try, step by step; each step's outcome.

    Run inside a real worker, every step must fail; run anywhere unconfined, they succeed (the test
    shows both).
    """
    import ctypes
    import mmap
    import socket

    libc = ctypes.CDLL(None, use_errno=True)

    def read(path: str):
        def go() -> None:
            with open(path, "rb") as f:
                f.read(64)

        return go

    def mem() -> None:
        fd = os.open(f"/proc/{gateway_pid}/mem", os.O_RDONLY)
        try:
            os.pread(fd, 16, 0x400000)
        except OSError as exc:
            if exc.errno != 5:  # EIO: opened, but no page at that address; the open is the breach
                raise
        finally:
            os.close(fd)

    def rewrite_spool() -> None:
        fd = os.open(f"/dev/shm/{spool_name}", os.O_RDWR)
        try:
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[:5] = b"EVIL!"
        finally:
            os.close(fd)

    def write_audit() -> None:
        with open(audit_db, "r+b") as f:
            f.seek(0)
            f.write(b"X")

    def map_audit() -> None:
        fd = os.open(audit_db, os.O_RDWR)
        try:
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[100] = m[100]
        finally:
            os.close(fd)

    def network() -> None:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()

    def execve() -> None:
        # A directory is never executable: EACCES says the call reached the kernel's exec path (the
        # process would have been replaced by a real program), EPERM that the filter refused it.
        try:
            os.execv("/", ["/"])
        except PermissionError as exc:
            if exc.errno != 13:
                raise

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    def ptrace() -> None:
        # PTRACE_SEIZE: attached without stopping the target; detached when this process ends.
        if libc.ptrace(0x4206, gateway_pid, None, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def write_handed() -> None:
        """Rewrite whatever file a descriptor this process holds is (the part it was handed, read-only)."""
        import stat

        for fd in range(3, 256):
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
            except OSError:
                continue
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                m[:1] = b"X"
            return
        raise OSError(9, "no file descriptor to write")

    return {
        "environ": _outcome(read(f"/proc/{gateway_pid}/environ")),
        "mem": _outcome(mem),
        "spool_by_name": _outcome(rewrite_spool),
        "audit_open": _outcome(write_audit),
        "audit_mmap": _outcome(map_audit),
        "other_path": _outcome(read(other_path)),
        "network": _outcome(network),
        "execve": _outcome(execve),
        "fork": _outcome(fork),
        "ptrace": _outcome(ptrace),
        "handed_file": _outcome(write_handed),
        "environment": ",".join(sorted(k for k in os.environ if k.startswith("OMNIGATE"))) or "empty",
    }


_PAGE = 4096
#: unmapped address space a walk crosses before it stops (arenas and libraries are rarely further apart)
_GAP = 64 << 20


def finds_secrets(halves: list[tuple[str, str]]) -> dict[str, object]:
    """Which of the secrets (each ``head + tail``) lie in this process's own memory, as a decoder
    running the attacker's code would look for them: ``/proc/self/environ`` where it can be read, the
    environment, and every readable page mapped around the stack, the heap and the allocators'
    arenas, found without ``/proc``. Each answer is the indexes of the secrets found there.

    A secret comes in two halves and is only ever compared half by half, so the search itself never
    puts it in memory. A page is walked to where ``mincore`` says it is mapped and read through a pipe
    (``write`` from its address): a page that cannot be read, or is unmapped meanwhile, fails with
    EFAULT instead of killing the reader.
    """
    import ctypes

    wanted = [(head.encode(), tail.encode()) for head, tail in halves]
    edge = max(len(a) + len(b) for a, b in wanted)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]

    def holds(data: bytes) -> set[int]:
        hits = set()
        for i, (first, rest) in enumerate(wanted):
            at = data.find(first)
            while at >= 0 and i not in hits:
                if data[at + len(first) : at + len(first) + len(rest)] == rest:
                    hits.add(i)
                at = data.find(first, at + 1)
        return hits

    found: dict[str, object] = {}
    try:
        with open("/proc/self/environ", "rb") as f:
            found["proc_environ"] = sorted(holds(f.read()))
    except OSError as exc:
        found["proc_environ"] = type(exc).__name__
    found["environ"] = sorted(set().union(*(holds(v.encode()) for v in os.environ.values())))

    vec = ctypes.create_string_buffer(1)
    r, w = os.pipe()
    seen: set[int] = set()
    pages = 0

    def page_at(page: int) -> bytes | None:
        """The page's bytes, copied by the kernel through a pipe (None where it cannot be read)."""
        n = libc.write(w, page, _PAGE)
        if n <= 0:
            return None
        data = os.read(r, n)
        return data if n == _PAGE else None

    def walk(seed: int) -> set[int]:
        """The secrets on the readable pages mapped around ``seed``, up and down, until a long gap."""
        nonlocal pages
        hits: set[int] = set()
        for step in (-_PAGE, _PAGE):
            page, gap, carry = (seed & ~(_PAGE - 1)) + (_PAGE if step > 0 else 0), 0, b""
            while gap < _GAP and 0 < page < 1 << 47:
                data = None
                if libc.mincore(page, _PAGE, vec) == 0:
                    gap = 0
                    if page not in seen:
                        seen.add(page)
                        data = page_at(page)
                else:
                    gap += _PAGE
                if data is None:
                    carry = b""
                else:
                    pages += 1
                    # with its neighbour's edge, so a secret across two pages is found too
                    hits |= holds(carry + data if step > 0 else data + carry)
                    carry = data[-edge:] if step > 0 else data[:edge]
                page += step
        return hits

    small = bytes(range(40))  # a small object: in one of the interpreter's own arenas
    large = bytearray(1 << 20)  # a large one: mapped by the C library's allocator
    seeds = {
        "stack": ctypes.c_void_p.in_dll(libc, "program_invocation_name").value or 0,
        "arena": id(small),
        "heap": libc.sbrk(0) or 0,
        "mapped": ctypes.addressof((ctypes.c_char * len(large)).from_buffer(large)),
    }
    try:
        memory: dict[str, list[int]] = {}
        for name, seed in seeds.items():
            hits = walk(seed) if seed else set()
            if hits:
                memory[name] = sorted(hits)
    finally:
        os.close(r)
        os.close(w)
    found["memory"] = memory
    found["pages"] = pages
    return found
