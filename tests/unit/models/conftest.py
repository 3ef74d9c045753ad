"""Shared fixtures: the tiny model, loaded once per test session (fp32 and bf16)."""

from __future__ import annotations

import pytest

from models import LoadedModel, load
from protocol.model_spec import TinyModelSpec


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load(TinyModelSpec(seed=0))


@pytest.fixture(scope="session")
def tiny_bf16() -> LoadedModel:
    return load(TinyModelSpec(seed=0), dtype="bfloat16")
