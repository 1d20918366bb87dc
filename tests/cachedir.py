"""Where the test suites keep what they build once per machine: the real engines' environments and models,
the openai-node SDK, the embedded engine's converted weights.

Outside the clone, so that a fresh clone of the repository (CI's, a second checkout) finds what this machine
already built instead of rebuilding it (the real-vLLM and vLLM-Omni environments alone take a quarter of an
hour). ``OMNIGATE_TEST_CACHE`` moves the whole of it; by default it is ``$XDG_CACHE_HOME/omnigate-tests``
(``~/.cache/omnigate-tests``). Each entry is stamped with what it was built from, so a changed pin or plugin
rebuilds it, and built under a lock, so two runs on one machine never build the same entry at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_home() -> Path:
    explicit = os.environ.get("OMNIGATE_TEST_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "omnigate-tests"


def entry(name: str, override_var: str | None = None) -> Path:
    """The folder of one cached entry; ``override_var`` names an older variable that moves just this one."""
    if override_var and os.environ.get(override_var):
        return Path(os.environ[override_var]).expanduser()
    return cache_home() / name


@contextmanager
def building(folder: Path) -> Iterator[None]:
    """Hold the build lock of ``folder`` (a sibling lock file): a second run waits, then finds it stamped."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
