"""Fixtures several HTTP test modules share; a module that needs a variant defines its own of the same name."""

from __future__ import annotations

import uuid

import pytest
from redis import asyncio as aioredis

from tests.http.rollout_helpers import REDIS, Trio


@pytest.fixture(scope="module")
def trio(bg):
    """The rollout tests' three scripted engines (INT4, INT8, BF16), started once per module."""
    t = Trio(bg)
    yield t
    t.stop()


@pytest.fixture
def fresh(trio):
    trio.reset()
    return trio


@pytest.fixture
def prefix(bg):
    """A Redis key prefix of this test's own; its keys are deleted afterwards."""
    p = f"omnigate-test:{uuid.uuid4().hex}"
    yield p

    async def _cleanup() -> None:
        r = aioredis.from_url(REDIS)
        keys = [k async for k in r.scan_iter(match=p + ":*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()

    bg.run(_cleanup())
