"""The command-line tools the ops tests drive: promtool (Debian's prometheus package, which
``.ci/run`` installs), and the ones pinned in the ``test`` extra next to this interpreter."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_VENV_BIN = Path(sys.executable).parent


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: install Debian's prometheus package (.ci/run does)")
    return path


def venv_tool(name: str) -> str:
    """A binary a pinned test dependency installed beside this interpreter (not a system one)."""
    path = _VENV_BIN / name
    assert path.is_file(), f"{name} missing from {_VENV_BIN}: install the project's test extra"
    return str(path)


def run(
    args: list[str],
    *,
    stdin: str | None = None,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, input=stdin, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
