"""Accepted work, hard and soft invalidation, slashing, rewards and their claim."""

from __future__ import annotations

import pytest
from chainfixtures import BUDGET, SETTINGS, TOKEN, TREASURY, Pools, work_key
from eth_utils import keccak

from contracts.pool import NodeStatus, WorkStatus
from protocol.errors import ChainError
from protocol.identity import Identity

EVIDENCE = keccak(text="toploc exponent mismatch, chunk 3")


def test_record_work_reserves_reward(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    receipt = pools.validator.record_work(node.address, key, 7)
    work = pools.validator.get_work(key)
    assert (work.node, work.status, work.units, work.reward) == (
        node.address, WorkStatus.ACCEPTED, 7, 7 * SETTINGS.reward_per_unit
    )
    assert pools.admin.reward_budget() == BUDGET - 7 * SETTINGS.reward_per_unit
    assert pools.admin.rewards_reserved() == 7 * SETTINGS.reward_per_unit
    assert pools.admin.get_node(node.address).accepted_units == 7
    (event,) = pools.admin.events(receipt.block_number, names={"WorkRecorded"})
    assert event.args == {"node": node.address, "workKey": key, "validator": pools.validator.identity.address,
                          "units": 7, "reward": 7 * SETTINGS.reward_per_unit}


def test_record_work_reverts(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    for client in (pools.stranger, pools.operator, pools.trainer, pools.admin):
        with pytest.raises(ChainError) as exc:
            client.record_work(node.address, key, 1)
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
    pools.validator.record_work(node.address, key, 1)
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, key, 1)
    assert exc.value.reason == "DuplicateWorkKey"
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, work_key(), 0)
    assert exc.value.reason == "ZeroUnits"
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(Identity.create().address, work_key(), 1)
    assert exc.value.reason == "NodeNotActive"
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, work_key(), BUDGET // SETTINGS.reward_per_unit + 1)
    assert exc.value.reason == "InsufficientRewardBudget"
    pools.operator.leave_pool(node.address)
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, work_key(), 1)
    assert exc.value.reason == "NodeNotActive"
    with pytest.raises(ChainError, match="32 bytes"):
        pools.validator.record_work(node.address, b"short", 1)


def test_hard_invalidation_slashes_to_treasury_and_ejects(pools: Pools) -> None:
    node = pools.new_node(stake=SETTINGS.min_stake + 2 * TOKEN)
    token = pools.token()
    treasury = pools.chain.account(TREASURY).address
    validator = pools.validator.identity.address
    kept, bad = work_key(), work_key()
    pools.validator.record_work(node.address, kept, 3)
    pools.validator.record_work(node.address, bad, 5)
    treasury_before, validator_before = token.balance_of(treasury), token.balance_of(validator)
    budget_before = pools.admin.reward_budget()

    receipt = pools.validator.invalidate_hard(node.address, bad, 17, EVIDENCE)

    assert token.balance_of(treasury) == treasury_before  # in escrow until the appeal window closes
    assert pools.admin.get_escrow(bad).amount == SETTINGS.slash_penalty
    assert token.balance_of(validator) == validator_before  # the slasher earns nothing
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.EJECTED
    assert info.stake == SETTINGS.min_stake + 2 * TOKEN - SETTINGS.slash_penalty
    assert info.accepted_units == 3
    assert pools.admin.get_work(bad).status is WorkStatus.HARD_INVALIDATED
    assert pools.admin.reward_budget() == budget_before + 5 * SETTINGS.reward_per_unit
    events = {e.name: e.args for e in pools.admin.events(receipt.block_number)}
    assert events["WorkInvalidated"] == {"node": node.address, "workKey": bad, "validator": validator,
                                         "hard": True, "reasonCode": 17, "evidenceHash": EVIDENCE}
    assert events["StakeSlashed"] == {"node": node.address, "workKey": bad, "treasury": treasury,
                                      "amount": SETTINGS.slash_penalty}
    assert events["NodeEjected"]["unbondingEnd"] == info.unbonding_end

    # An ejected node takes no more work and its key cannot come back.
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, work_key(), 1)
    assert exc.value.reason == "NodeNotActive"
    with pytest.raises(ChainError) as exc:
        pools.operator2.register(node, SETTINGS.min_stake)
    assert exc.value.reason == "NodeIsEjected"
    # Its other work can still be invalidated while the window is open (slashing the rest of the stake).
    pools.validator.invalidate_hard(node.address, kept, 17, EVIDENCE)
    assert pools.admin.get_node(node.address).stake == SETTINGS.min_stake + 2 * TOKEN - 2 * SETTINGS.slash_penalty
    # The remaining stake unbonds, then is withdrawable by the operator.
    with pytest.raises(ChainError) as exc:
        pools.operator.withdraw(node.address)
    assert exc.value.reason == "StillUnbonding"
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    before = token.balance_of(pools.operator.identity.address)
    pools.operator.withdraw(node.address)
    assert token.balance_of(pools.operator.identity.address) == before + SETTINGS.min_stake + 2 * TOKEN - 2 * SETTINGS.slash_penalty
    assert pools.admin.get_node(node.address).status is NodeStatus.EJECTED


def test_hard_invalidation_reverts(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 2)
    for client in (pools.stranger, pools.operator, pools.trainer, pools.admin):
        with pytest.raises(ChainError) as exc:
            client.invalidate_hard(node.address, key, 1, EVIDENCE)
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
        with pytest.raises(ChainError) as exc:
            client.invalidate_soft(node.address, key, 1)
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
    pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE)
    with pytest.raises(ChainError) as exc:  # slashing one work key twice
        pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE)
    assert exc.value.reason == "WorkNotAccepted"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_soft(node.address, key, 1)
    assert exc.value.reason == "WorkNotAccepted"


def test_invalidation_after_window_reverts(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 2)
    pools.chain.advance_time(SETTINGS.invalidation_window + 1)
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE)
    assert exc.value.reason == "InvalidationWindowClosed"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_soft(node.address, key, 1)
    assert exc.value.reason == "InvalidationWindowClosed"
    assert pools.admin.get_node(node.address).status is NodeStatus.ACTIVE


def test_penalty_is_capped_at_stake(pools: Pools) -> None:
    node = pools.new_node()
    pools.admin.set_slash_penalty(10**30)
    key = work_key()
    pools.validator.record_work(node.address, key, 1)
    receipt = pools.validator.invalidate_hard(node.address, key, 2, EVIDENCE)
    assert pools.admin.get_node(node.address).stake == 0
    (event,) = pools.admin.events(receipt.block_number, names={"StakeSlashed"})
    assert event.args["amount"] == SETTINGS.min_stake
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    with pytest.raises(ChainError) as exc:
        pools.operator.withdraw(node.address)
    assert exc.value.reason == "NothingToWithdraw"


def test_slashing_a_leaving_node(pools: Pools) -> None:
    """Leaving does not escape a verdict: unbonding stake is still slashable within the window."""
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 1)
    pools.operator.leave_pool(node.address)
    pools.validator.invalidate_hard(node.address, key, 3, EVIDENCE)
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake - SETTINGS.slash_penalty


def test_soft_invalidation_removes_work_only(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 4)
    budget = pools.admin.reward_budget()
    receipt = pools.validator.invalidate_soft(node.address, key, 9)
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.stake == SETTINGS.min_stake and info.accepted_units == 0
    assert pools.admin.get_work(key).status is WorkStatus.SOFT_INVALIDATED
    assert pools.admin.reward_budget() == budget + 4 * SETTINGS.reward_per_unit
    assert pools.admin.rewards_reserved() == 0
    (event,) = pools.admin.events(receipt.block_number)
    assert event.name == "WorkInvalidated" and event.args["hard"] is False and event.args["reasonCode"] == 9
    with pytest.raises(ChainError) as exc:  # a removed work key stays used
        pools.validator.record_work(node.address, key, 4)
    assert exc.value.reason == "DuplicateWorkKey"


def test_rewards_lock_then_claim(pools: Pools) -> None:
    node = pools.new_node()
    other = pools.new_node(pools.operator2)
    keys = [work_key(), work_key()]
    pools.validator.record_work(node.address, keys[0], 10)
    pools.validator.record_work(node.address, keys[1], 20)
    other_key = work_key()
    pools.validator.record_work(other.address, other_key, 1)
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, keys)
    assert exc.value.reason == "RewardLocked"
    pools.chain.advance_time(SETTINGS.reward_lock_period + 1)
    with pytest.raises(ChainError) as exc:
        pools.stranger.claim_rewards(node.address, keys)
    assert exc.value.reason == "NotOperator"
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [*keys, other_key])
    assert exc.value.reason == "WorkOfOtherNode"
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [work_key()])
    assert exc.value.reason == "UnknownWorkKey"
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [])
    assert exc.value.reason == "BadParameters"
    before = pools.operator.token.balance_of(pools.operator.identity.address)
    receipt = pools.operator.claim_rewards(node.address, keys)
    paid = 30 * SETTINGS.reward_per_unit
    assert pools.operator.token.balance_of(pools.operator.identity.address) == before + paid
    assert pools.admin.rewards_reserved() == SETTINGS.reward_per_unit  # only other's remains
    assert {pools.admin.get_work(k).status for k in keys} == {WorkStatus.CLAIMED}
    (event,) = pools.admin.events(receipt.block_number, names={"RewardsClaimed"})
    assert event.args == {"node": node.address, "operator": pools.operator.identity.address,
                          "amount": paid, "workCount": 2}
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, keys[:1])
    assert exc.value.reason == "WorkNotAccepted"
    # Claimed work is past its window anyway, and cannot be invalidated.
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard(node.address, keys[0], 1, EVIDENCE)
    assert exc.value.reason == "WorkNotAccepted"


def test_invalidated_work_earns_nothing(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 10)
    pools.validator.invalidate_soft(node.address, key, 1)
    pools.chain.advance_time(SETTINGS.reward_lock_period + 1)
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [key])
    assert exc.value.reason == "WorkNotAccepted"


def test_rewards_of_a_withdrawn_node_stay_claimable(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 10)
    pools.operator.leave_pool(node.address)
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    pools.operator.withdraw(node.address)
    pools.operator.claim_rewards(node.address, [key])
    assert pools.admin.get_work(key).status is WorkStatus.CLAIMED


def test_record_work_batch(pools: Pools) -> None:
    a, b = pools.new_node(), pools.new_node(pools.operator2)
    keys = [work_key() for _ in range(3)]
    receipt = pools.validator.record_work_batch([(a.address, keys[0], 1), (b.address, keys[1], 2),
                                                 (a.address, keys[2], 3)])
    assert [pools.admin.get_work(k).units for k in keys] == [1, 2, 3]
    assert len(pools.admin.events(receipt.block_number, names={"WorkRecorded"})) == 3
    assert pools.admin.get_node(a.address).accepted_units == 4
    fresh = work_key()
    with pytest.raises(ChainError) as exc:  # one bad item spoils the batch: nothing is recorded
        pools.validator.record_work_batch([(a.address, fresh, 1), (b.address, work_key(), 0)])
    assert exc.value.reason == "ZeroUnits"
    assert pools.admin.get_work(fresh).status is WorkStatus.NONE
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work_batch([])
    assert exc.value.reason == "BadParameters"
    with pytest.raises(ChainError) as exc:
        pools.stranger.record_work_batch([(a.address, work_key(), 1)])
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    with pytest.raises(ChainError) as exc:  # units beyond uint48 do not even encode
        pools.validator.record_work(a.address, work_key(), 1 << 48)
    assert exc.value.reason == "bad_argument"


def test_zero_penalty_still_ejects_without_a_transfer(pools: Pools) -> None:
    node = pools.new_node()
    pools.admin.set_slash_penalty(0)
    key = work_key()
    pools.validator.record_work(node.address, key, 1)
    receipt = pools.validator.invalidate_hard(node.address, key, 4, EVIDENCE)
    names = [e.name for e in pools.admin.events(receipt.block_number)]
    assert names == ["WorkInvalidated", "NodeEjected", "SlashEscrowed"]
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake
