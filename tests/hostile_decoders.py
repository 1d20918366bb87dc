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
