"""The start-up sweep of spool files that killed gateways left behind (:mod:`core.spooled`'s files).

Split from :mod:`core.spooled`, which re-exports these names: the sweep runs once as the media runtime
starts, never while a request is served.
"""

from __future__ import annotations

import fcntl
import os

#: where the files go: the POSIX shared-memory file system
SHM_DIR = "/dev/shm"
#: the start of every spool file's name, followed by the owner's pid (see :func:`sweep`)
PREFIX = "omnigate-"


def sweep() -> list[str]:
    """Remove the spool files that killed gateways left behind; the names removed.

    A file is this gateway's kind by its prefix; it is stale when the process its name names is gone
    and no process holds it open with :func:`core.spooled.hold`'s lock (a gateway in another pid namespace sharing
    the file system, or one whose pid was reused since, keeps its files). A kill that takes out every
    process of a gateway, its resource tracker too, leaves its files to the next start.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        owner = _owner(entry.name)
        if owner is None or owner == os.getpid() or _alive(owner):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held open by a live gateway
            continue
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _owner(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX) :].partition("-")[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
