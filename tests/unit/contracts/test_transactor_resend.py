"""A transaction the chain loses is sent again and lands once: dropped from the pool, stuck (replaced with
higher fees), rolled back with its block (a snapshot and revert standing in for a reorg)."""

from __future__ import annotations

import pytest
from chainfaults import Background, manual_mining, nonce, pending, recorded, wait_for, watchful
from chainfixtures import TRAINER, VALIDATOR, Pools, work_key

from contracts.pool import WorkStatus

pytestmark = pytest.mark.timeout(120)


def recorded_events(pools: Pools, key: bytes) -> int:
    return recorded(pools.admin, key)


def test_a_dropped_transaction_is_sent_again_and_lands_once(pools: Pools) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, resend_after_s=600.0)
    key = work_key()
    before = nonce(chain, validator.address)
    with manual_mining(chain):
        send = Background(lambda: client.record_work(node.address, key, 3))
        wait_for(lambda: len(pending(chain, validator.address)) == 1, "the transaction in the pool")
        chain.rpc("anvil_dropAllTransactions")
        assert pending(chain, validator.address) == []
        wait_for(lambda: client.tx.resent >= 1, "the transactor to notice the drop")
        wait_for(lambda: len(pending(chain, validator.address)) == 1, "the resent transaction in the pool")
        chain.rpc("evm_mine")
        receipt = send.result()
    assert not receipt.replayed
    assert client.get_work(key).status is WorkStatus.ACCEPTED and client.get_work(key).units == 3
    assert nonce(chain, validator.address) == before + 1  # one transaction, the same nonce
    assert recorded_events(pools, key) == 1


def test_a_stuck_low_fee_transaction_is_replaced_with_a_fee_bump(pools: Pools) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, resend_after_s=0.3, priority_fee_wei=1)
    key = work_key()
    before = nonce(chain, validator.address)
    with manual_mining(chain):
        send = Background(lambda: client.record_work(node.address, key, 1))
        wait_for(lambda: client.tx.resent >= 1, "a replacement")
        wait_for(lambda: any(int(tx["maxPriorityFeePerGas"], 16) > 1 for tx in pending(chain, validator.address)),
                 "the replacement in the pool")
        assert len(pending(chain, validator.address)) == 1  # replaced, not added
        chain.rpc("evm_mine")
        receipt = send.result()
    mined = chain.web3().eth.get_transaction(receipt.tx_hash)  # type: ignore[arg-type]
    assert int(mined["maxPriorityFeePerGas"]) > 1 and int(mined["nonce"]) == before
    assert nonce(chain, validator.address) == before + 1
    assert recorded_events(pools, key) == 1


def test_a_rolled_back_receipt_is_noticed_and_the_transaction_lands_again_once(pools: Pools) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator)
    first, second = work_key(), work_key()
    snapshot = chain.snapshot()
    client.record_work(node.address, first, 1)
    client.record_work(node.address, second, 2)
    chain.revert(snapshot)  # both blocks leave the chain
    assert client.get_work(first).status is WorkStatus.NONE
    assert client.tx.reconcile() == 2
    assert client.get_work(first).status is WorkStatus.ACCEPTED and client.get_work(second).units == 2
    assert client.tx.reconcile() == 0  # landed again: nothing more to send
    assert recorded_events(pools, first) == 1 and recorded_events(pools, second) == 1


def test_a_resend_that_reverts_because_the_action_is_on_chain_counts_as_done(pools: Pools) -> None:
    """The rolled-back transaction's nonce went to another transaction of the same key (another process):
    it is re-signed under a fresh nonce, reverts (DuplicateWorkKey), and the chain shows the work: done."""
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator)
    other = watchful(chain, pools.deployment.pool, validator)
    key = work_key()
    snapshot = chain.snapshot()
    client.record_work(node.address, key, 1)
    chain.revert(snapshot)
    other.record_work_batch([(node.address, key, 1)])  # same nonce, another transaction
    assert client.tx.reconcile() == 1
    assert client.get_work(key).status is WorkStatus.ACCEPTED
    assert recorded_events(pools, key) == 1


def test_policy_history_sees_a_version_published_again_below_its_cursor_after_a_rollback(pools: Pools) -> None:
    """A reader of events that only read blocks past its cursor missed a publishPolicy sent again after a
    rollback (it lands at a height already read): the devnet's node stayed on the old version for good."""
    from contracts.policy import PolicyHistory

    history = PolicyHistory(pools.admin, pools.deployment.start_block)
    snapshot = pools.chain.snapshot()
    pools.trainer.publish_policy(2, b"\x0a" * 32)
    assert 2 in history.refresh() and history.manifest_hash(2) == b"\x0a" * 32
    pools.chain.revert(snapshot)
    # another trainer process (a fresh client: nothing of the first to send again) publishes at that height
    pools.client(TRAINER).publish_policy(2, b"\x0b" * 32)
    assert history.refresh() == [2]
    assert history.manifest_hash(2) == b"\x0b" * 32
