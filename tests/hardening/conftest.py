"""The hardening suites' figures: each test records what it measured; the run prints them and can save them.

``figures(**values)`` records a test's measurements under its name. At the end of the
run they are printed in the terminal summary, and with ``OMNIGATE_FIGURES=FILE`` written
there as JSON (``bench/results-suites.json`` holds the run quoted in ``bench/RESULTS.md``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_FIGURES: dict[str, dict[str, Any]] = {}


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[..., None]:
    name = request.node.nodeid.split("/")[-1]

    def record(**values: Any) -> None:
        _FIGURES.setdefault(name, {}).update(values)

    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("hardening figures")
    for name, values in _FIGURES.items():
        shown = ", ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in values.items())
        terminalreporter.write_line(f"{name}: {shown}")
    out = os.environ.get("OMNIGATE_FIGURES")
    if out:
        Path(out).write_text(json.dumps(_FIGURES, indent=2, sort_keys=True) + "\n")
