"""Rollbacks of any depth and nonce gaps never wedge a key (issue 39 item 1).

A 32-block revert (deeper than any confirmation count) once left the transactor's cached nonce above the
chain's: every later transaction waited in anvil's queue above the gap, for good. Here the rolled-back
transactions land again under their own nonces, a restarted transactor finds them in its durable journal, a
gap that nothing of ours can fill is filled, a timed-out send leaves the key usable, and fees come from the
next block's base fee.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chainfaults import Background, manual_mining, nonce, pending, recorded, wait_for, watchful
from chainfixtures import VALIDATOR, Pools, work_key

from contracts.devchain import DevChain
from contracts.journal import FileJournal
from contracts.pool import PoolClient, WorkStatus
from protocol.errors import ChainError

pytestmark = pytest.mark.timeout(180)

DEPTH = 32  # blocks rolled back: far deeper than the 12 confirmations a landed transaction used to be watched


def test_a_rollback_deeper_than_the_confirmations_lands_every_removed_transaction_again(pools: Pools) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, receipt_timeout=30.0)
    keys = [work_key() for _ in range(3)]
    before = nonce(chain, validator.address)
    snapshot = chain.snapshot()
    for i, key in enumerate(keys):
        client.record_work(node.address, key, i + 1)
    chain.rpc("anvil_mine", [hex(DEPTH)])
    assert client.tx.reconcile() == 0  # a round with nothing lost (it once forgot every buried transaction)
    chain.revert(snapshot)
    assert nonce(chain, validator.address) == before
    assert all(client.get_work(k).status is WorkStatus.NONE for k in keys)

    after = work_key()
    client.record_work(node.address, after, 5)  # the next send is not queued above a gap
    assert [client.get_work(k).status for k in [*keys, after]] == [WorkStatus.ACCEPTED] * 4
    assert [client.get_work(k).units for k in keys] == [1, 2, 3]
    assert [recorded(pools.admin, k) for k in [*keys, after]] == [1, 1, 1, 1]
    assert nonce(chain, validator.address) == before + 4  # the lost ones under their own nonces, then the new one
    assert client.tx.reconcile() == 0


def test_a_restarted_transactor_sends_again_what_a_rollback_removed_while_it_was_down(pools: Pools,
                                                                                      tmp_path: Path) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    path = tmp_path / "transactions.sqlite"
    first = watchful(chain, pools.deployment.pool, validator, journal=FileJournal(path))
    keys = [work_key(), work_key()]
    snapshot = chain.snapshot()
    first.record_work_batch([(node.address, keys[0], 1)])
    first.record_work_batch([(node.address, keys[1], 2)])
    chain.rpc("anvil_mine", [hex(DEPTH)])
    del first  # killed: nothing of it survives but its journal file
    chain.revert(snapshot)

    restarted = watchful(chain, pools.deployment.pool, validator, journal=FileJournal(path))
    assert restarted.tx.reconcile() == 2
    assert [restarted.get_work(k).units for k in keys] == [1, 2]
    assert [recorded(pools.admin, k) for k in keys] == [1, 1]
    assert restarted.tx.reconcile() == 0
    again = watchful(chain, pools.deployment.pool, validator, journal=FileJournal(path))
    assert again.tx.reconcile() == 0  # landed again and journalled as such: a third process sends nothing


def mined_until(chain: DevChain, client: PoolClient, key: bytes) -> bool:
    """Mine one block; True once `key` is recorded."""
    chain.rpc("evm_mine")
    return client.get_work(key).status is WorkStatus.ACCEPTED


def test_a_nonce_gap_that_nothing_of_ours_holds_is_filled(pools: Pools) -> None:
    """Another process of this key sent nonce N, and the pool lost it: our transaction at N + 1 waits in the
    queue for good unless N is filled."""
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, resend_after_s=0.5)
    w3 = chain.web3()
    gap = nonce(chain, validator.address)
    key = work_key()
    with manual_mining(chain):
        elsewhere = validator.account.sign_transaction({
            "to": validator.address, "value": 0, "gas": 21_000, "nonce": gap, "chainId": w3.eth.chain_id,
            "maxFeePerGas": 10**11, "maxPriorityFeePerGas": 10**9})
        w3.eth.send_raw_transaction(elsewhere.raw_transaction)
        send = Background(lambda: client.record_work(node.address, key, 4))
        wait_for(lambda: len(pending(chain, validator.address)) == 2, "both transactions in the pool")
        chain.rpc("anvil_dropTransaction", [elsewhere.hash.to_0x_hex()])
        chain.rpc("evm_mine")
        assert nonce(chain, validator.address) == gap  # ours waits above the gap
        wait_for(lambda: client.tx.filled >= 1, "the gap filled")
        wait_for(lambda: mined_until(chain, client, key), "the filler, then ours, mined")
        receipt = send.result()
    assert int(w3.eth.get_transaction(receipt.tx_hash)["nonce"]) == gap + 1  # type: ignore[arg-type]
    assert client.get_work(key).units == 4 and recorded(pools.admin, key) == 1


def test_a_send_that_timed_out_leaves_the_key_usable(pools: Pools) -> None:
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, receipt_timeout=1.0, resend_after_s=600.0)
    before = nonce(chain, validator.address)
    with manual_mining(chain):
        with pytest.raises(ChainError) as timed_out:
            client.record_work(node.address, work_key(), 1)
        chain.rpc("anvil_dropAllTransactions")  # the chain never took it
    assert timed_out.value.reason == "timeout"
    key = work_key()
    client.record_work(node.address, key, 2)  # not queued above the nonce of the lost one
    assert client.get_work(key).units == 2 and nonce(chain, validator.address) == before + 1


def test_fees_come_from_the_next_blocks_base_fee(pools: Pools) -> None:
    """A transaction priced from the latest block, when the next one costs more (far more than the tip), cannot
    enter it: anvil refuses it, a pool that takes it never mines it (and under automine no block follows)."""
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    client = watchful(chain, pools.deployment.pool, validator, receipt_timeout=15.0, resend_after_s=600.0)
    spike = 100 * int(chain.web3().eth.get_block("latest")["baseFeePerGas"]) + 50 * 10**9  # 50 gwei over a 1 gwei tip
    chain.rpc("anvil_setNextBlockBaseFeePerGas", [hex(spike)])
    key = work_key()
    receipt = client.record_work(node.address, key, 3)
    assert client.get_work(key).units == 3
    mined = chain.web3().eth.get_transaction(receipt.tx_hash)  # type: ignore[arg-type]
    assert int(mined["maxFeePerGas"]) >= spike


def test_a_transaction_whose_sender_died_before_its_receipt_is_still_watched_after_a_restart(
        pools: Pools, tmp_path: Path) -> None:
    """Killed between the send and the receipt (here: the send gave up), the journal still names the transaction:
    the restarted transactor learns that it landed, and sends it again when a deep rollback removes it."""
    node = pools.new_node()
    chain, validator = pools.chain, pools.chain.account(VALIDATOR)
    path = tmp_path / "transactions.sqlite"
    first = watchful(chain, pools.deployment.pool, validator, journal=FileJournal(path), receipt_timeout=1.0,
                     resend_after_s=600.0)
    key = work_key()
    snapshot = chain.snapshot()
    with manual_mining(chain):
        with pytest.raises(ChainError):
            first.record_work(node.address, key, 7)
        chain.rpc("evm_mine")  # it lands after its sender stopped waiting
    del first
    restarted = watchful(chain, pools.deployment.pool, validator, journal=FileJournal(path))
    assert restarted.tx.reconcile() == 0  # landed: journalled as such, nothing to send
    chain.rpc("anvil_mine", [hex(DEPTH)])
    chain.revert(snapshot)
    assert restarted.get_work(key).status is WorkStatus.NONE
    assert restarted.tx.reconcile() == 1
    assert restarted.get_work(key).units == 7 and recorded(pools.admin, key) == 1


def test_a_fee_spike_inside_a_snapshot_is_gone_after_the_revert(devchain: DevChain) -> None:
    """`DevChain.revert` puts the next block's base fee back: anvil's `evm_revert` alone keeps the fee the reverted
    blocks led to, so one test's spike (above) priced a later test's transaction out of the next block (CI run 23:
    `test_resending_the_same_signed_transaction_is_harmless`, 'max fee per gas less than block base fee')."""
    def next_fee() -> int:
        return int(devchain.rpc("eth_getBlockByNumber", ["pending", False])["baseFeePerGas"], 16)

    before = next_fee()
    snapshot = devchain.snapshot()
    devchain.rpc("anvil_setNextBlockBaseFeePerGas", [hex(100 * before + 50 * 10**9)])
    devchain.rpc("evm_mine")
    assert next_fee() > 10 * before
    devchain.revert(snapshot)
    assert next_fee() == before
