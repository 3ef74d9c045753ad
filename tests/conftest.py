"""Settings for the whole test suite.

torch on a 2-core box collapses when its threads are oversubscribed (NOTES.md: 30-40x), and the
suite runs next to servers and subprocesses, so every test runs torch on one intra-op thread.
OMP_NUM_THREADS is set before any test module imports torch (and is inherited by subprocesses);
the fixture puts the count back to 1 after a test that raised it (e.g. the 2-thread TOPLOC check).
"""

from __future__ import annotations

import os
import sys

import benchsmoke
import pytest


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(trylast=True)  # after --random-order has shuffled
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The bench smoke tests last, whatever the order: their runs then have the whole suite to finish in."""
    items.sort(key=lambda item: getattr(item, "originalname", "") == benchsmoke.TEST)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected benchmarks' smoke runs in the background (tests/benchsmoke.py says why)."""
    if session.config.option.collectonly:
        return
    benchsmoke.start([item.callspec.params["name"] for item in session.items
                      if getattr(item, "originalname", "") == benchsmoke.TEST])


def pytest_sessionfinish(session: pytest.Session) -> None:
    benchsmoke.stop()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    torch = sys.modules.get("torch")  # never import torch for tests that do not use it
    if torch is not None:
        torch.set_num_threads(1)
