"""Bytes that cross between the gateway and its decoding workers through shared memory.

The parent leaves a large argument in a segment (:class:`SharedBytes`) and reserves a file for a large
output (:class:`SharedOut`); the worker reads the one and writes into the other. A worker never opens
either by name: the sandbox opens the file in the gateway and hands the worker its descriptor
(:class:`Handed`), read-only for an argument. Kept apart from the worker's module so that the media
parts and the worker both use it without importing each other.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.shared_memory import SharedMemory


@dataclass(frozen=True, slots=True)
class SharedBytes:
    """A task argument's bytes, left by the parent in a shared-memory segment it owns and unlinks."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class SharedOut:
    """A file the parent reserved for a task's output: the worker maps it and writes into it.

    In the gateway it is named; in the worker it is the descriptor the gateway handed over (``fd``).
    """

    name: str
    size: int
    fd: int | None = None


@dataclass(frozen=True, slots=True)
class Handed:
    """What a worker receives in a shared file's place: the token its descriptor is fetched by."""

    token: str
    size: int
    writable: bool = False


def write_out(out: SharedOut, data: bytes) -> bool:
    """Write ``data`` into the parent's reserved file; False (nothing written) where it does not fit."""
    if len(data) > out.size:
        return False
    if not data:
        return True
    if out.fd is None:
        raise ValueError("a worker writes only into a file it was handed")
    # Mapped, not written: a worker may not write files (RLIMIT_FSIZE is 0), but may fill a mapping.
    with mmap.mmap(out.fd, out.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[: len(data)] = data
    return True


def mapped(shm: SharedMemory) -> memoryview:
    """The mapping of an open segment (typeshed allows None: the buffer of a closed one)."""
    buf = shm.buf
    assert buf is not None
    return buf
