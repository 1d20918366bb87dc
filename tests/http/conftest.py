"""Fixtures several HTTP test modules share; a module that needs a variant defines its own of the same name."""

from __future__ import annotations

import pytest

from tests.console_setup import Engines


@pytest.fixture(scope="module")
def eng(bg):
    """The console tests' scripted engines, started once per module."""
    e = Engines(bg)
    yield e
    e.stop()
