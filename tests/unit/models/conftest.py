"""Shared fixtures: the tiny model, loaded once per test session (fp32 and bf16)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from models import LoadedModel, kernels, load
from protocol.model_spec import TinyModelSpec


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load(TinyModelSpec(seed=0))


@pytest.fixture(scope="session")
def tiny_bf16() -> LoadedModel:
    return load(TinyModelSpec(seed=0), dtype="bfloat16")


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Engines built here without ``kernel_cache=`` measure into a temp dir, not ``~/.cache``."""
    directory = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "default_cache_dir", lambda: directory)
        yield
