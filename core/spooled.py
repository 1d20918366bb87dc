"""Media payloads of a request body kept outside the process heap while the request lives.

A request body carrying 14 MB of base64 used to be resident twice at its peak (the body and the
parsed string) before its media step had decoded anything, whatever the part became: a 2-minute
44.1 kHz WAV the gateway shrinks to a 1.4 MB FLAC still cost 28 MB. The body reader
(:mod:`gateway.api.body`) now decodes each long base64 payload as it arrives into a file of the
shared-memory file system, written with ``write`` and never mapped by the gateway, and the parsed
request carries a :class:`SpooledMedia` in the part's place. The decoding workers get the file as a
read-only descriptor the gateway opened (they cannot open it by name); an engine body re-encodes it
a piece at a time as the connection takes it; nothing holds the part whole in the gateway's memory
unless an adapter must hand a library one string (litellm) or bytes (the embedded engine).

The file lives as long as the request references it: it is unlinked when the last reference goes
(``weakref.finalize``), and it is registered with multiprocessing's resource tracker, which unlinks
what a killed gateway left behind; what a kill of every process left, the next start sweeps
(:func:`core.spool_sweep.sweep`). Its bytes are counted against the media budgets as they are written.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import secrets
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Any, Protocol

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

# Re-exported: the spool's place and names, and the start-up sweep, are imported from here.
from core.spool_sweep import PREFIX as PREFIX
from core.spool_sweep import SHM_DIR as SHM_DIR
from core.spool_sweep import sweep as sweep

#: decoded bytes read back per piece when re-encoding (a multiple of 3: pieces encode on their own)
_READ = 3 << 16
#: bytes reserved at a time while writing (a full file system is an error then, never a SIGBUS later)
_RESERVE = 1 << 20


class SpoolFull(OSError):
    """No room for the payload in the shared-memory file system: the reader keeps it in memory instead."""


class SpooledMedia:
    """A part's base64 payload, decoded into a shared-memory file: what the parsed request carries.

    ``header`` is what preceded the base64 in the client's string (``data:audio/wav;base64,``, or
    empty for ``input_audio``'s plain base64); ``size`` the decoded bytes; ``name`` the segment's
    name for ``multiprocessing.shared_memory``. ``text()`` is the header and the base64 of the bytes,
    canonical; ``sha256()`` the digest of the client's string exactly as it arrived (which differs
    from ``text()`` where the client's last group had non-zero padding bits).
    """

    __slots__ = (
        "__weakref__",
        "_digest",
        "_fd",
        "_finalizer",
        "b64_length",
        "header",
        "name",
        "size",
    )

    def __init__(
        self,
        header: str,
        name: str,
        fd: int,
        size: int,
        b64_length: int,
        digest: str | None = None,
        charged: Callable[[], None] | None = None,
    ) -> None:
        self.header = header
        self.name = name
        self.size = size
        self.b64_length = b64_length
        self._digest = digest
        self._fd = fd
        self._finalizer = weakref.finalize(self, _remove, name, fd, charged)

    def __len__(self) -> int:
        """The length of the client's string (header and base64), as ``len`` of it would be."""
        return len(self.header) + self.b64_length

    def __repr__(self) -> str:
        return f"SpooledMedia({self.header[:60]!r}, {self.size} bytes)"

    def __reduce__(self) -> tuple[object, ...]:
        # Never pickled to a worker by accident (the file would be unlinked under it): workers get the name.
        raise TypeError("SpooledMedia is not picklable; send SharedBytes(name, size)")

    def __copy__(self) -> SpooledMedia:
        return self  # the payload does not change: copies of a request share it

    def __deepcopy__(self, memo: dict[int, object]) -> SpooledMedia:
        return self

    # -- as a field of the wire models: accepted only as itself (JSON cannot make one), dumped as the
    # client's string in JSON mode, kept as itself in Python mode (an engine body streams it)
    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.is_instance_schema(
            cls,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda v, info: v.text() if info.mode == "json" else v, info_arg=True
            ),
        )

    def read(self) -> bytes:
        """The decoded bytes, whole (for an adapter that needs them so)."""
        return os.pread(self._fd, self.size, 0)

    def base64_pieces(self) -> Iterator[str]:
        """The payload's base64 (without the header), a piece at a time, re-encoded from the file."""
        for at in range(0, self.size, _READ):
            yield base64.b64encode(os.pread(self._fd, min(_READ, self.size - at), at)).decode("ascii")

    def pieces(self) -> Iterator[str]:
        """The client's string a piece at a time: the header, then the base64."""
        if self.header:
            yield self.header
        yield from self.base64_pieces()

    def text(self) -> str:
        """The client's string, whole (what an adapter handing a library one string needs)."""
        return "".join(self.pieces())

    def sha256(self) -> str:
        """The hex SHA-256 of the client's string as it arrived (hashed while it was spooled), or of
        :meth:`text`, a piece at a time, for a payload made without one."""
        if self._digest is not None:
            return self._digest
        h = hashlib.sha256()
        for piece in self.pieces():
            h.update(piece.encode("ascii"))
        return h.hexdigest()

    def release(self) -> None:
        """Unlink the file now (otherwise when the last reference goes)."""
        self._finalizer()


class SpoolBudget(Protocol):
    """Where a request's spooled bytes are counted as they are written (the media budgets)."""

    def charge(self, n: int) -> None:
        """Count ``n`` more bytes, or raise the budget's error (the file is then discarded)."""

    def refund(self, n: int) -> None:
        """Give back ``n`` bytes counted before."""


class _Charge:
    """The bytes one file holds of a budget; given back once, whoever ends the file."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: SpoolBudget | None) -> None:
        self.budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        if self.budget is not None and n > 0:
            self.budget.charge(n)
        self.held += n

    def give(self, n: int | None = None) -> None:
        n = self.held if n is None else min(n, self.held)
        self.held -= n
        if self.budget is not None and n > 0:
            self.budget.refund(n)


class SpoolWriter:
    """One payload being written: ``write`` decoded bytes as they come, then ``finish`` for the part.

    With a ``budget``, the bytes are counted as the file grows (each reservation before it is made),
    so a body whose payloads exceed it is refused while it arrives, not once it is complete; the
    count is given back when the file goes. ``text`` hashes the client's characters as they pass.
    """

    def __init__(self, budget: SpoolBudget | None = None) -> None:
        # The owner's pid in the name: which replica's a file is (and a unique name among them).
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
        self._path = os.path.join(SHM_DIR, self.name)
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SpoolFull(str(exc)) from None
        hold(self._fd)
        # The tracker unlinks the file if this process dies before it does (as for SharedMemory).
        resource_tracker.register("/" + self.name, "shared_memory")
        self._charge = _Charge(budget)
        # A body abandoned mid-payload (a timeout, a client gone) drops its writer: the file goes with it.
        self._finalizer = weakref.finalize(self, _remove, self.name, self._fd, self._charge.give)
        self.size = 0
        self._reserved = 0
        self._hash = hashlib.sha256()

    def text(self, chars: bytes) -> None:
        """The client's characters of this payload (header and base64), hashed as they arrive."""
        self._hash.update(chars)

    def write(self, data: bytes) -> None:
        end = self.size + len(data)
        if end > self._reserved:
            want = max(end, self._reserved + _RESERVE)
            self._grow(want)
        os.pwrite(self._fd, data, self.size)
        self.size = end

    def _grow(self, want: int) -> None:
        self._charge.take(want - self._reserved)  # counted before the pages are
        try:
            os.posix_fallocate(self._fd, self._reserved, want - self._reserved)
        except OSError as exc:
            raise SpoolFull(str(exc)) from None
        self._reserved = want

    def reserve(self, size: int) -> None:
        """Size the file to ``size`` bytes, its space reserved, for a worker to write into by mapping it
        (a decoding worker may not write files, but may fill a mapping); then ``wrote(n)`` and ``finish``."""
        if size > self._reserved:
            self._grow(size)

    @property
    def reserved(self) -> int:
        return self._reserved

    def wrote(self, n: int) -> None:
        """A worker filled the first ``n`` bytes of the reserved file."""
        assert n <= self._reserved
        self.size = n

    def read_back(self) -> bytes:
        """What was written so far (when the reader gives up on spooling this string)."""
        return os.pread(self._fd, self.size, 0)

    def finish(self, header: str, b64_length: int) -> SpooledMedia:
        """The payload, which owns the file (and its count in the budget) from here on."""
        os.ftruncate(self._fd, self.size)  # the workers map the file's size: exactly the payload
        self._charge.give(self._reserved - self.size)
        self._finalizer.detach()
        digest = self._hash.hexdigest() if b64_length else None
        return SpooledMedia(header, self.name, self._fd, self.size, b64_length, digest, self._charge.give)

    def discard(self) -> None:
        self._finalizer()


def _remove(name: str, fd: int, charged: Callable[[], None] | None = None) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    resource_tracker.unregister("/" + name, "shared_memory")
    if charged is not None:
        charged()


def hold(fd: int) -> None:
    """Mark an open spool file as in use (a shared lock for as long as the file is open here), so a
    gateway sweeping what a killed one left never removes it."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def available() -> bool:
    """Whether payloads can be spooled here (a writable shared-memory file system)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
