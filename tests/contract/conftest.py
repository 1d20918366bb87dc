"""Fixtures the contract test modules share."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def client(gateway):
    """The official openai SDK pointed at this module's ``gateway``, without retries of its own."""
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c
