"""The reporter on a chain that loses transactions (issue 26 item 5): a dropped recordWorkBatch is sent again
while the reporter waits, one rolled back after its rows were marked reported is sent again at the next
round, and every key is recorded exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from chainfaults import Background, manual_mining, pending, recorded, wait_for, watchful
from chainfixtures import VALIDATOR, Pools

from contracts.pool import WorkStatus
from validator.ledger import Decision, Ledger
from validator.reporter import Reporter

pytestmark = pytest.mark.timeout(120)


def _accepted(ledger: Ledger, node: str, n: int, start: int) -> list[str]:
    keys = [f"0x{i:064x}" for i in range(start, start + n)]
    for i, key in enumerate(keys):
        ledger.insert(work_key=key, submission_hash=f"0x{start + i + 1000:064x}", node=node, policy_version=1,
                      counter=start + i, envelope=b"{}",
                      decision=Decision(outcome="accepted", reason="accepted", measurements={"units": 2}))
    return keys


def test_reporter_survives_a_drop_and_a_rollback_without_double_recording(published: Pools, tmp_path: Path) -> None:
    chain, me = published.chain, published.chain.account(VALIDATOR)
    node = published.new_node()
    ledger = Ledger.open(path=tmp_path / "ledger.sqlite")
    pool = watchful(chain, published.deployment.pool, me)
    reporter = Reporter(ledger, pool, batch=8, hold_hard_s=0.0)

    dropped = _accepted(ledger, node.address, 2, start=1)
    with manual_mining(chain):
        drain = Background(reporter.drain)
        wait_for(lambda: len(pending(chain, me.address)) == 1, "recordWorkBatch in the pool")
        chain.rpc("anvil_dropAllTransactions")
        wait_for(lambda: len(pending(chain, me.address)) == 1, "recordWorkBatch sent again")
        chain.rpc("evm_mine")
        assert drain.result() == 2
    assert pool.tx.resent == 1

    snapshot = chain.snapshot()
    rolled = _accepted(ledger, node.address, 2, start=10)
    assert reporter.drain() == 2
    assert all(pool.get_work(k).status is WorkStatus.ACCEPTED for k in rolled)
    chain.revert(snapshot)  # the block with the batch leaves the chain; the ledger says reported
    assert all(pool.get_work(k).status is WorkStatus.NONE for k in rolled)
    assert reporter.drain() == 0  # nothing left in the outbox, and yet:
    assert all(pool.get_work(k).status is WorkStatus.ACCEPTED for k in rolled)
    assert reporter.drain() == 0
    assert [recorded(pool, k) for k in dropped + rolled] == [1, 1, 1, 1]
    assert ledger.outbox("accepted", 100) == []


def test_rows_a_deep_rollback_removed_land_again_after_a_restart(published: Pools, tmp_path: Path) -> None:
    """Issue 39 item 1: a 32-block revert (deeper than the 12 confirmations a landed batch used to be watched)
    removed two batches marked reported, and the validator was restarted: its journal, kept with its state,
    sends them again at the next round, and the next batch is not queued above a nonce gap."""
    from contracts.journal import FileJournal

    chain, me = published.chain, published.chain.account(VALIDATOR)
    node = published.new_node()
    ledger = Ledger.open(path=tmp_path / "ledger.sqlite")
    journal = tmp_path / "transactions.sqlite"
    reporter = Reporter(ledger, watchful(chain, published.deployment.pool, me, journal=FileJournal(journal)),
                        batch=2, hold_hard_s=0.0)
    snapshot = chain.snapshot()
    rolled = _accepted(ledger, node.address, 4, start=20)
    assert reporter.drain() == 4  # two batches
    chain.rpc("anvil_mine", [hex(32)])
    assert reporter.drain() == 0
    chain.revert(snapshot)
    pool = watchful(chain, published.deployment.pool, me, journal=FileJournal(journal), receipt_timeout=30.0)
    restarted = Reporter(ledger, pool, batch=2, hold_hard_s=0.0)
    later = _accepted(ledger, node.address, 1, start=30)
    assert restarted.drain() == 1
    assert all(pool.get_work(k).status is WorkStatus.ACCEPTED for k in rolled + later)
    assert [recorded(pool, k) for k in rolled + later] == [1] * 5
    assert ledger.outbox("accepted", 100) == []
