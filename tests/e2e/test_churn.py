"""Churn on a real devnet (bench/churn.py): node-0's process group is killed for good and a new node joins;
the trainer keeps stepping while node-0 is dead (before the new node came), and after it joined, the new
node's work is accepted, and the audit reconciles (nothing lost, nothing paid twice; the dead node is read
from its record on disk). Slow tier: a few minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchload import load_bench


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_training_goes_on_while_a_node_dies_for_good_and_another_joins(tmp_path: Path) -> None:
    churn = load_bench("churn")

    res = churn.run(True, 60.0, tmp_path)
    assert res["steps_while_dead_before_join"] >= 1, res
    assert res["steps_after_join"] >= 1, res
    assert res["joined"]["accepted"] >= 1, res
    assert res["audit"]["ok"], res["audit"]["mismatches"]
