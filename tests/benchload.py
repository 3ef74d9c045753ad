"""Import a bench/ program as a module (`bench.<name>`), for tests that call its functions."""

from __future__ import annotations

import importlib
from typing import Any


def load_bench(name: str) -> Any:
    """`bench/<name>.py`, imported as `bench.<name>`."""
    return importlib.import_module(f"bench.{name}")
