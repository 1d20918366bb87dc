"""The incident replay bench runs: a tiny run of its offload incident, so the bench cannot rot unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def test_a_tiny_replay_of_the_offload_incident_limits_sleeps_and_wakes():
    out = subprocess.run(
        [sys.executable, "-m", "bench.incidents", "--tiny", "--only", "offload", "--rate", "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| VRAM pressure")]
    assert len(rows) == 1, out.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    requests, failed = int(cells[1]), int(cells[2])
    assert requests > 0 and failed == 0
    actions = cells[5]
    for step in (
        "limit_concurrency(vram-pressure)",
        "sleep(vram-pressure)",
        "wake(vram-pressure)",
        "awake(vram-pressure)",
    ):
        assert step in actions, actions
    assert "BF16 requests while asleep or waking: 0" in cells[0]
