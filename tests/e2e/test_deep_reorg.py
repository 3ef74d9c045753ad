"""A 32-block rollback under a running devnet (issue 39 item 1; bench/faults.py `--only reorg`): deeper than
any confirmation count, it once wedged every chain writer for good (the chain's nonce fell below the
transactors', whose transactions then waited above the gap), the trainer stopped publishing and the audit
failed with "reported, not on chain". Now the trainer trains again, the version and every removed work record
are on chain again, and the audit reconciles. Slow tier: a devnet for minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchload import load_bench


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_32_block_rollback_is_repaired_and_the_audit_reconciles(tmp_path: Path) -> None:
    faults = load_bench("faults")

    res = faults.run(nodes=2, quick=True, state_root=tmp_path, only=["reorg"])
    r = res["deep_reorg"]
    assert r["depth_blocks"] >= faults.REORG_DEPTH and r["records_removed"] > 0, r
    assert set(r["recovery_s"]) == {"training_resumed", "version_on_chain_again", "work_recorded_again"}
    assert res["deep_reorg_resume_s"] is not None
    assert res["deep_reorg_audit_ok"], r["audit"]["rows"]
    assert res["audit"]["ok"], res["audit"]["rows"]
