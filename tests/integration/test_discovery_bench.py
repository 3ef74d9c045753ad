"""`bench.discovery` at a tiny scale, so the bench cannot rot: three real libp2p hosts on 127.0.0.1 in a sparse
mesh, with our signed announcements and bare gossipsub; every announcement reaches every host, and the
receiver of the rate measurement admits what it counts. Behaviour only, never timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchload import load_bench

# slow tier (`make test-slow`): keeps the bench program from rotting; the behaviour it checks is covered in the
# default tier by the validator, shardcast and discovery integration tests, and CI's 15 minutes are nearly spent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("discovery")


def test_mesh_is_sparse_and_connected(bench: Any) -> None:
    links = bench._mesh(16)
    assert sum(map(len, links)) < 16 * 15 // 2  # not all-to-all
    reached, frontier = {0}, [0]
    while frontier:  # every host reachable from host 0 over the (undirected) links
        i = frontier.pop()
        for j in [*links[i], *(k for k, ts in enumerate(links) if i in ts)]:
            if j not in reached:
                reached.add(j)
                frontier.append(j)
    assert reached == set(range(16))


@pytest.mark.timeout(120)
def test_reach_and_rate_at_tiny_scale(bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SETTLE_S", 1.2)
    monkeypatch.setattr(bench, "IDLE_S", 1.0)
    reach = bench.measure_reach(3, 3, tmp_path)
    for side in ("ours", "bare"):
        assert 0 < reach[side]["p50_s"] <= reach[side]["p99_s"]
    assert reach["envelope_bytes"] > 200
    rate = bench.measure_rate(1.0, tmp_path, senders=2)
    assert rate["ours"]["received"] > 0 and rate["bare"]["received"] > 0
    assert rate["ours"]["received"] <= sum(rate["ours"]["sent"])
    assert not any(k != "dropped.stale" for k in rate["ours"]["dropped"]), rate["ours"]["dropped"]
