"""`bench.load` at a tiny scale, so the load harness cannot rot: a real validator (anvil, its own
process, every loop on) under honest and junk traffic from a few senders, and a relay serving a few
concurrent pulls. Behaviour only (every answer typed as expected, nothing lost, limits held), never timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchload import load_bench

# slow tier (`make test-slow`): keeps the bench program from rotting; the behaviour it checks is covered in the
# default tier by the validator, shardcast and discovery integration tests, and CI's 15 minutes are nearly spent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def load() -> Any:
    return load_bench("load")


@pytest.mark.timeout(120)
def test_validator_holds_its_limits_and_loses_no_honest_work(load: Any, tmp_path: Path) -> None:
    # 0.5/s with a burst of 2: the greedy sender's ~25 rate-checked requests on 4 connections cannot all
    # pass on any machine, so the limit is exercised; honest work is each sender's first request.
    spec = load.ValidatorLoad(senders=4, requests=120, honest=4, rate=0.5, burst=2, greedy_senders=1, greedy_conns=4,
                              greedy_share=0.25, anchor_requests=20, decide_timeout_s=60, traffic_timeout_s=60)
    res = load.validator_load(spec, tmp_path)
    assert res["requests_sent"] >= 120
    assert res["unexpected_answers"] == {}
    assert {"malformed", "forged", "replay", "reseal", "nonce_reuse", "honest"} <= set(res["mix"])
    honest = res["honest"]
    assert honest["honest_submitted"] == 4 and honest["lost"] == 0 and honest["missing"] == []
    assert honest["outcomes"] == {"accepted:accepted": 4}
    assert honest["ledger_rows_not_honest"] == 0  # no junk, replay or reseal made a row
    rl = res["rate_limit"]
    assert rl["held"] and rl["violations"] == []
    assert rl["refused_429_greedy"] > 0
    assert res["rss_samples"] > 0


@pytest.mark.timeout(120)
def test_relay_serves_concurrent_pulls_that_all_verify(load: Any, tmp_path: Path) -> None:
    spec = load.RelayLoad(pulls=6, ckpt_vocab=512, ckpt_hidden=64, ckpt_layers=1, shard_mib=1, timeout_s=60)
    res = load.relay_load(spec, tmp_path)
    assert res["failed"] == []
    assert res["completed"] == res["verified_same"] == 6
    assert res["hash_failures"] == 0
    assert res["relay_rss_samples"] > 0


@pytest.mark.timeout(240)
def test_a_flood_of_cheap_failures_leaves_the_ledger_bounded(load: Any, tmp_path: Path) -> None:
    spec = load.FloodLoad(keys=2, duration_s=6.0, slash_after_s=1.0, node_bytes_per_window=48 << 10, max_backlog=2000)
    res = load.flood_load(spec, tmp_path)
    held, unheld = res["defaults"], res["unheld"]
    # the shipped bounds: one row per key, held until its slash lands, then out of the pool
    assert held["rows"] == 2 and held["statuses"].get("403") == 2
    # slashes held back: the bytes per node per window bound each key (two fixed windows at most)
    per_key = 2 * (spec.node_bytes_per_window // unheld["submission_bytes"])
    assert 2 <= unheld["rows"] <= 2 * per_key and unheld["statuses"].get("429", 0) > 0
    assert unheld["refusals"].get("refused_node_quota", 0) > 0
