"""Engine faults under load (each mode ``OMNIGATE_FAULT_ROUNDS`` times, 16 at once): clean endings, no repeats."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.faults import MODES, run_keepalive, run_mode, start

pytestmark = pytest.mark.timeout(600)

ROUNDS = int(os.environ.get("OMNIGATE_FAULT_ROUNDS", "200"))


@pytest.fixture(scope="module")
def rig(bg):
    gateway, primary, fallback = start(bg)
    yield bg, gateway, primary, fallback
    gateway.stop()
    bg.run(primary.stop())
    bg.run(fallback.stop())


@pytest.mark.parametrize("mode", list(MODES))
def test_every_stream_ends_cleanly(rig, mode, figures):
    out = asyncio.run(run_mode(*rig, mode, ROUNDS, 16))
    figures(**{k: v for k, v in out.items() if k != "failures"})
    assert out["requests"] == ROUNDS
    assert out["non_200"] == 0, out["failures"]
    assert out["clean"] == ROUNDS, out["failures"]
    # Failover only before the first byte, once per engine at most: never more attempts than engines.
    assert out["attempts_per_request"] <= 2.0
    if not MODES[mode][1]:
        assert out["ended_with_error_frame"] == 0  # a fault before the first byte is invisible to clients


def test_idle_keepalive_connections_closed_by_the_engine_cost_nothing(rig, figures):
    out = asyncio.run(run_keepalive(*rig))
    figures(**{k: v for k, v in out.items() if isinstance(v, (int, float, str))})
    assert out["clean"] == out["requests"]
