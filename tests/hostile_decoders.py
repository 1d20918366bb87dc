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
