"""Appending to a file so that the bytes are on disk before the call returns."""

from __future__ import annotations

import os
from pathlib import Path


def append_fsynced(path: Path, data: bytes, mode: int) -> None:
    """Append ``data`` to ``path`` (created with ``mode``, folder included) and fsync it; blocking."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
