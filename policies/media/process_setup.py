"""The gateway process's own set-up for media, done once at start: its memory allocator and its dumpability."""

from __future__ import annotations

import ctypes

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
