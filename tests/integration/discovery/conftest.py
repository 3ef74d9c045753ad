"""Fixtures of the libp2p discovery integration tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from discovery_harness import Net


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    network = Net(tmp_path)
    try:
        yield network
    finally:
        network.stop_all()
    # Shutdown is clean: no host thread is left (trio's idle worker-thread cache is daemonic and
    # not ours; it is not counted).
    left = [t.name for t in threading.enumerate() if t.name.endswith("-trio")]
    assert left == [], left
