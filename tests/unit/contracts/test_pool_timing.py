"""Time on the pool: the clock stops while paused, and the window and lock boundaries never overlap."""

from __future__ import annotations

import pytest
from chainfixtures import ADMIN, OPERATOR, SETTINGS, TOKEN, TREASURY, VALIDATOR, Pools, work_key
from eth_utils import keccak

from contracts.deployment import deploy_pool
from contracts.pool import NodeStatus, PoolClient, WorkStatus
from contracts.transactor import Transactor, connect
from protocol.errors import ChainError
from protocol.identity import Identity

EVIDENCE = keccak(text="sampling replay mismatch at token 12")
PAUSE = 3 * SETTINGS.unbonding_period  # longer than the window, the lock and unbonding together


def _block_time(pools: Pools) -> int:
    return int(pools.chain.web3().eth.get_block("latest")["timestamp"])


def _at(pools: Pools, timestamp: int) -> None:
    """Make `timestamp` the latest block's time and the next block's too, so that a transaction's gas
    estimate (run against the latest block) and its mined execution see the same second."""
    pools.chain.rpc("evm_setNextBlockTimestamp", [timestamp])
    pools.chain.rpc("evm_mine")
    pools.chain.rpc("evm_setNextBlockTimestamp", [timestamp])


def test_a_pause_does_not_eat_the_invalidation_window(pools: Pools) -> None:
    node = pools.new_node()
    bad, other = work_key(), work_key()
    pools.validator.record_work_batch([(node.address, bad, 2), (node.address, other, 3)])
    pools.admin.pause()
    pools.chain.advance_time(PAUSE)
    pools.admin.unpause()
    # The pool was frozen: the reward is still locked and the bad work can still be slashed.
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [other])
    assert exc.value.reason == "RewardLocked"
    pools.validator.invalidate_hard(node.address, bad, 1, EVIDENCE)
    assert pools.admin.get_work(bad).status is WorkStatus.HARD_INVALIDATED
    # The window still closes, and the lock still ends, after the unpaused time they were given.
    pools.chain.advance_time(SETTINGS.invalidation_window)
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_soft(node.address, other, 1)
    assert exc.value.reason == "InvalidationWindowClosed"
    pools.chain.advance_time(SETTINGS.reward_lock_period - SETTINGS.invalidation_window)
    pools.operator.claim_rewards(node.address, [other])
    assert pools.admin.get_work(other).status is WorkStatus.CLAIMED


def test_a_pause_does_not_shorten_unbonding(pools: Pools) -> None:
    """Stake stays slashable for its whole unbonding, however long the pool was paused meanwhile."""
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 1)
    pools.operator.leave_pool(node.address)
    pools.admin.pause()
    pools.chain.advance_time(PAUSE)
    pools.admin.unpause()
    with pytest.raises(ChainError) as exc:
        pools.operator.withdraw(node.address)
    assert exc.value.reason == "StillUnbonding"
    pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE)
    assert pools.admin.get_node(node.address).stake == SETTINGS.min_stake - SETTINGS.slash_penalty


def test_pool_time_stands_still_while_paused(pools: Pools) -> None:
    start = pools.admin.pool_time()
    assert start == _block_time(pools)  # never paused yet
    pools.admin.pause()
    paused_at = _block_time(pools)
    pools.chain.advance_time(1000)
    assert pools.admin.pool_time() == paused_at
    receipt = pools.admin.unpause()
    unpaused_at = int(pools.chain.web3().eth.get_block(receipt.block_number)["timestamp"])
    assert pools.admin.pool_time() == paused_at
    pools.chain.advance_time(50)
    assert pools.admin.pool_time() == _block_time(pools) - (unpaused_at - paused_at)
    # Work recorded now carries the pool clock, not the block time.
    node = pools.new_node()
    key = work_key()
    receipt = pools.validator.record_work(node.address, key, 1)
    mined = int(pools.chain.web3().eth.get_block(receipt.block_number)["timestamp"])
    assert pools.admin.get_work(key).recorded_at == mined - (unpaused_at - paused_at)


def _pool_with_lock_equal_to_window(pools: Pools) -> tuple[PoolClient, PoolClient]:
    """A second pool on the same token with the deploy defaults' shape: rewardLockPeriod == invalidationWindow."""
    settings = SETTINGS.model_copy(update={"reward_lock_period": SETTINGS.invalidation_window})
    tx = Transactor(connect(pools.chain.rpc_url), pools.chain.account(ADMIN))
    pools.token(ADMIN).mint(tx.address, 10 * TOKEN)  # the shared dev token: the admin mints this pool's budget
    d = deploy_pool(tx, treasury=pools.chain.account(TREASURY).address, settings=settings,
                    token=pools.deployment.token, validators=[pools.chain.account(VALIDATOR).address],
                    fund_rewards=10 * TOKEN)
    validator = PoolClient(connect(pools.chain.rpc_url), d.pool, pools.chain.account(VALIDATOR))
    operator = PoolClient(connect(pools.chain.rpc_url), d.pool, pools.chain.account(OPERATOR))
    return validator, operator


def test_window_and_lock_boundaries_are_disjoint(pools: Pools) -> None:
    validator, operator = _pool_with_lock_equal_to_window(pools)
    node = Identity.create()
    operator.register(node, SETTINGS.min_stake)
    early, late = work_key(), work_key()
    validator.record_work_batch([(node.address, early, 1), (node.address, late, 1)])
    recorded = validator.get_work(early).recorded_at
    closes = recorded + SETTINGS.invalidation_window
    assert validator.get_work(late).recorded_at == recorded

    _at(pools, closes - 1)  # the window's last second: invalidation only
    with pytest.raises(ChainError) as exc:
        operator.claim_rewards(node.address, [late])
    assert exc.value.reason == "RewardLocked"
    validator.invalidate_soft(node.address, early, 1)

    _at(pools, closes)  # the lock's first second: claim only
    with pytest.raises(ChainError) as exc:
        validator.invalidate_hard(node.address, late, 1, EVIDENCE)
    assert exc.value.reason == "InvalidationWindowClosed"
    with pytest.raises(ChainError) as exc:
        validator.invalidate_soft(node.address, late, 1)
    assert exc.value.reason == "InvalidationWindowClosed"
    operator.claim_rewards(node.address, [late])
    assert validator.get_work(late).status is WorkStatus.CLAIMED
    assert validator.get_node(node.address).status is NodeStatus.ACTIVE
