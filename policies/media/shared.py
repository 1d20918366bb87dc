"""Bytes that cross between the gateway and its decoding workers through shared memory.

The parent leaves a large argument in a segment (:class:`SharedBytes`) and reserves a file for a large
output (:class:`SharedOut`); the worker reads the one and writes into the other. Kept apart from the
worker's module so that the media parts and the worker both use it without importing each other.
"""

from __future__ import annotations

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
    """A file the parent reserved for a task's output: the worker maps it and writes into it."""

    name: str
    size: int


def write_out(out: SharedOut, data: bytes) -> bool:
    """Write ``data`` into the parent's reserved file; False (nothing written) where it does not fit."""
    if len(data) > out.size:
        return False
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=out.name)
    try:
        mapped(shm)[: len(data)] = data
    finally:
        shm.close()
    return True


def read_shared(arg: SharedBytes) -> bytes:
    """The bytes of a task argument the parent left in a shared-memory segment (a copy, in the worker)."""
    from multiprocessing import shared_memory

    # Attaching registers the segment with the resource tracker again; a forkserver worker shares
    # the parent's tracker, where that is a no-op and the parent's unlink is the one unregistration.
    shm = shared_memory.SharedMemory(name=arg.name)
    try:
        with mapped(shm)[: arg.size] as view:
            return bytes(view)
    finally:
        shm.close()


def mapped(shm: SharedMemory) -> memoryview:
    """The mapping of an open segment (typeshed allows None: the buffer of a closed one)."""
    buf = shm.buf
    assert buf is not None
    return buf
