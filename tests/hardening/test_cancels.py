"""Random client cancels, streaming and not: every one reaches the engine as an abort."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.cancels import run_cancels, start

pytestmark = pytest.mark.timeout(300)

ROUNDS = int(os.environ.get("OMNIGATE_CANCEL_ROUNDS", "200"))


def test_every_cancel_aborts_the_engine(bg, figures):
    gateway, up = start(bg)
    try:
        out = asyncio.run(run_cancels(bg, gateway, up, ROUNDS))
    finally:
        gateway.stop()
        bg.run(up.stop())
    figures(**{f"{mode}_{k}": v for mode, row in out.items() for k, v in row.items()})
    for mode in ("stream", "json"):
        assert out[mode]["cancels"] == ROUNDS // 2
        assert out[mode]["aborts_seen"] == out[mode]["cancels"], out
    assert bg.call(lambda: up.completed) == 0
