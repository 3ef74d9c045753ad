"""The fault suite (bench/faults.py) on a real devnet: kill -9 a relay, a validator, the trainer and a node
in the middle of their work, one at a time; each is restarted by `prime-devnet up --restart` and does
useful work again (next version served, next batch accepted, next step trained, next batch accepted),
and the audit reconciles afterwards. Slow tier: minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchload import load_bench


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_role_recovers_from_kill_9_and_the_audit_reconciles(tmp_path: Path) -> None:
    faults = load_bench("faults")

    res = faults.run(nodes=2, quick=True, state_root=tmp_path)
    assert [f["role"] for f in res["faults"]] == ["relay", "validator", "trainer", "node"]
    wanted = {"relay": {"back", "next_version_served", "self_next_version_installed_by_a_node"},
              "validator": {"back", "next_batch_accepted", "self_next_batch_accepted_anywhere"},
              "trainer": {"back", "next_step_trained", "next_version_on_chain"},
              "node": {"back", "all_signed_before_kill_accepted", "next_batch_accepted"}}
    for f in res["faults"]:
        assert set(f["recovery_s"]) == wanted[f["role"]], f
        assert all(s >= 0 for s in f["recovery_s"].values())
    assert any("restarted" in line for line in res["restarts"])
    assert res["audit"]["ok"], res["audit"]["rows"]
