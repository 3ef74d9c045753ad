"""Fixtures for environment tests."""

from __future__ import annotations

import pytest

from tests.unit.environments.sandbox_modes import skip_unless_mode


@pytest.fixture(params=["namespaces", "uid", "none"])
def sandbox_mode(request: pytest.FixtureRequest) -> str:
    """Each isolation mode the machine supports: namespaces and uid as root, none otherwise."""
    mode = str(request.param)
    skip_unless_mode(mode)
    return mode
