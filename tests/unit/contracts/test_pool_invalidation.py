"""Invalidating work that was never recorded, and resending a batch whose outcome is unknown.

A submission that fails its first check is never recorded, yet its node must be slashable (hard) and its
key must never be paid (soft or hard). A chain reporter that lost a receipt resends its batch.
"""

from __future__ import annotations

import pytest
from chainfixtures import BUDGET, SETTINGS, TOKEN, TREASURY, Pools, work_key
from eth_utils import keccak

from contracts.pool import NodeStatus, WorkStatus
from protocol.errors import ChainError
from protocol.identity import Identity

EVIDENCE = keccak(text="ledger row 42: toploc exponent mismatches 19/24")


def test_hard_invalidation_of_a_key_never_recorded_slashes_and_consumes_it(pools: Pools) -> None:
    node = pools.new_node(stake=SETTINGS.min_stake + TOKEN)
    key = work_key()
    token = pools.token()
    treasury, validator = pools.chain.account(TREASURY).address, pools.validator.identity.address
    treasury_before, validator_before = token.balance_of(treasury), token.balance_of(validator)

    receipt = pools.validator.invalidate_hard(node.address, key, 21, EVIDENCE)

    invalidated_at = pools.admin.pool_time()
    assert token.balance_of(treasury) == treasury_before  # in escrow for the appeal window (test_pool_appeals)
    assert pools.admin.total_escrow() == SETTINGS.slash_penalty
    pools.chain.advance_time(SETTINGS.appeal_window)
    pools.stranger.release_escrow(key)
    assert token.balance_of(treasury) == treasury_before + SETTINGS.slash_penalty
    assert token.balance_of(validator) == validator_before  # the slasher earns nothing
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake + TOKEN - SETTINGS.slash_penalty
    assert info.accepted_units == 0
    assert pools.admin.reward_budget() == BUDGET and pools.admin.rewards_reserved() == 0  # nothing was reserved
    work = pools.admin.get_work(key)
    assert (work.node, work.status, work.units, work.reward) == (node.address, WorkStatus.HARD_INVALIDATED, 0, 0)
    assert work.known and work.invalidated and not work.was_recorded
    assert work.recorded_at == invalidated_at  # when it was invalidated (same block, never paused)
    events = {e.name: e.args for e in pools.admin.events(receipt.block_number)}
    assert events["WorkInvalidated"] == {"node": node.address, "workKey": key, "validator": validator,
                                         "hard": True, "reasonCode": 21, "evidenceHash": EVIDENCE}
    assert events["StakeSlashed"] == {"node": node.address, "workKey": key, "treasury": treasury,
                                      "amount": SETTINGS.slash_penalty}
    assert events["NodeEjected"]["unbondingEnd"] == info.unbonding_end
    # The key can never be recorded, or paid, afterwards.
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, key, 1)
    assert exc.value.reason == "DuplicateWorkKey"
    pools.chain.advance_time(SETTINGS.reward_lock_period + 1)
    with pytest.raises(ChainError) as exc:
        pools.operator.claim_rewards(node.address, [key])
    assert exc.value.reason == "WorkNotAccepted"


def test_soft_invalidation_of_a_key_never_recorded_consumes_it_without_a_slash(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    receipt = pools.validator.invalidate_soft(node.address, key, 3)
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.stake == SETTINGS.min_stake
    work = pools.admin.get_work(key)
    assert (work.node, work.status, work.units, work.reward) == (node.address, WorkStatus.SOFT_INVALIDATED, 0, 0)
    (event,) = pools.admin.events(receipt.block_number)
    assert event.name == "WorkInvalidated" and event.args["hard"] is False and event.args["evidenceHash"] == bytes(32)
    with pytest.raises(ChainError) as exc:
        pools.validator.record_work(node.address, key, 1)
    assert exc.value.reason == "DuplicateWorkKey"
    budget = pools.admin.reward_budget()
    receipt = pools.validator.record_work_batch([(node.address, key, 5)])  # skipped, not recorded
    assert [e.name for e in pools.admin.events(receipt.block_number)] == ["WorkSkipped"]
    assert pools.admin.reward_budget() == budget and pools.admin.get_work(key).status is WorkStatus.SOFT_INVALIDATED
    # A soft verdict is final: a later hard one on the same key is refused (the key is used).
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE)
    assert exc.value.reason == "WorkNotAccepted"


def test_the_slash_follows_the_nodes_state(pools: Pools) -> None:
    """Leaving nodes are ejected and slashed; a key never registered is consumed with nothing to slash."""
    leaving = pools.new_node()
    pools.operator.leave_pool(leaving.address)
    pools.validator.invalidate_hard(leaving.address, work_key(), 1, EVIDENCE)
    info = pools.admin.get_node(leaving.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake - SETTINGS.slash_penalty

    stranger = Identity.create().address
    key = work_key()
    total = pools.admin.total_stake()
    receipt = pools.validator.invalidate_hard(stranger, key, 1, EVIDENCE)
    assert [e.name for e in pools.admin.events(receipt.block_number)] == ["WorkInvalidated", "SlashEscrowed"]
    assert pools.admin.get_escrow(key).amount == 0  # nothing to take; the verdict is still appealable
    assert pools.admin.get_node(stranger).status is NodeStatus.NONE and pools.admin.total_stake() == total
    assert pools.admin.get_work(key).node == stranger


def test_invalidation_reverts(pools: Pools) -> None:
    node, other = pools.new_node(), pools.new_node(pools.operator2)
    recorded, fresh = work_key(), work_key()
    pools.validator.record_work(node.address, recorded, 2)

    # Not a validator: for recorded and for unknown keys alike.
    for client in (pools.stranger, pools.operator, pools.trainer, pools.admin):
        for key in (recorded, fresh):
            with pytest.raises(ChainError) as exc:
                client.invalidate_hard(node.address, key, 1, EVIDENCE)
            assert exc.value.reason == "AccessControlUnauthorizedAccount"
            with pytest.raises(ChainError) as exc:
                client.invalidate_soft(node.address, key, 1)
            assert exc.value.reason == "AccessControlUnauthorizedAccount"
    # The wrong node for a recorded key.
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard(other.address, recorded, 1, EVIDENCE)
    assert exc.value.reason == "WorkOfOtherNode"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_soft(other.address, recorded, 1)
    assert exc.value.reason == "WorkOfOtherNode"
    # No evidence, or no node.
    for key in (recorded, fresh):
        with pytest.raises(ChainError) as exc:
            pools.validator.invalidate_hard(node.address, key, 1, bytes(32))
        assert exc.value.reason == "ZeroEvidenceHash"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard("0x" + "00" * 20, fresh, 1, EVIDENCE)
    assert exc.value.reason == "ZeroAddress"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_soft("0x" + "00" * 20, fresh, 1)
    assert exc.value.reason == "ZeroAddress"
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard("not an address", fresh, 1, EVIDENCE)
    assert exc.value.reason == "bad_argument"
    # None of that changed anything.
    assert pools.admin.get_work(fresh).status is WorkStatus.NONE
    assert pools.admin.get_work(recorded).status is WorkStatus.ACCEPTED
    assert {pools.admin.get_node(n.address).status for n in (node, other)} == {NodeStatus.ACTIVE}

    # Already invalidated: recorded then invalidated, and never recorded then invalidated.
    pools.validator.invalidate_soft(node.address, recorded, 1)
    pools.validator.invalidate_hard(other.address, fresh, 1, EVIDENCE)
    for key, owner in ((recorded, node), (fresh, other)):
        with pytest.raises(ChainError) as exc:
            pools.validator.invalidate_hard(owner.address, key, 1, EVIDENCE)
        assert exc.value.reason == "WorkNotAccepted"
        with pytest.raises(ChainError) as exc:
            pools.validator.invalidate_soft(owner.address, key, 1)
        assert exc.value.reason == "WorkNotAccepted"
    with pytest.raises(ChainError) as exc:  # the key is on record for `other` now
        pools.validator.invalidate_soft(node.address, fresh, 1)
    assert exc.value.reason == "WorkOfOtherNode"


def test_invalidation_window_closed_for_recorded_work(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 2)
    pools.chain.advance_time(SETTINGS.invalidation_window)
    for call in (lambda: pools.validator.invalidate_hard(node.address, key, 1, EVIDENCE),
                 lambda: pools.validator.invalidate_soft(node.address, key, 1)):
        with pytest.raises(ChainError) as exc:
            call()
        assert exc.value.reason == "InvalidationWindowClosed"
    assert pools.admin.get_node(node.address).stake == SETTINGS.min_stake


def test_a_resent_batch_is_skipped_not_recorded_twice(pools: Pools) -> None:
    a, b = pools.new_node(), pools.new_node(pools.operator2)
    items = [(a.address, work_key(), 1), (b.address, work_key(), 2), (a.address, work_key(), 3)]
    pools.validator.record_work_batch(items)
    state = (pools.admin.reward_budget(), pools.admin.rewards_reserved(),
             pools.admin.get_node(a.address).accepted_units, pools.admin.get_node(b.address).accepted_units)
    assert state[1:] == (6 * SETTINGS.reward_per_unit, 4, 2)

    receipt = pools.validator.record_work_batch(items)  # the reporter lost the receipt and sends it again

    events = pools.admin.events(receipt.block_number)
    assert [e.name for e in events] == ["WorkSkipped"] * 3
    assert [(e.args["node"], e.args["workKey"], e.args["status"]) for e in events] == [
        (node, key, WorkStatus.ACCEPTED) for node, key, _ in items
    ]
    assert events[0].args["validator"] == pools.validator.identity.address
    assert (pools.admin.reward_budget(), pools.admin.rewards_reserved(),
            pools.admin.get_node(a.address).accepted_units, pools.admin.get_node(b.address).accepted_units) == state


def test_a_batch_skips_every_known_key_and_records_the_rest(pools: Pools) -> None:
    node, ejected = pools.new_node(), pools.new_node(pools.operator2)
    recorded, invalidated, fresh, late = work_key(), work_key(), work_key(), work_key()
    pools.validator.record_work(node.address, recorded, 1)
    pools.validator.record_work(ejected.address, late, 1)
    pools.validator.invalidate_hard(ejected.address, invalidated, 1, EVIDENCE)  # ejects it
    budget = pools.admin.reward_budget()

    receipt = pools.validator.record_work_batch([
        (node.address, recorded, 1),  # already recorded
        (node.address, invalidated, 1),  # invalidated before it was recorded: on record for `ejected`
        (ejected.address, late, 1),  # recorded before its node was ejected: skipped, not NodeNotActive
        (node.address, fresh, 4),  # new
        (node.address, fresh, 4),  # the same key twice in one batch: recorded once
    ])

    events = [(e.name, e.args["node"], e.args["workKey"], e.args.get("status"))
              for e in pools.admin.events(receipt.block_number)]
    assert events == [
        ("WorkSkipped", node.address, recorded, WorkStatus.ACCEPTED),
        ("WorkSkipped", ejected.address, invalidated, WorkStatus.HARD_INVALIDATED),
        ("WorkSkipped", ejected.address, late, WorkStatus.ACCEPTED),
        ("WorkRecorded", node.address, fresh, None),
        ("WorkSkipped", node.address, fresh, WorkStatus.ACCEPTED),
    ]
    assert pools.admin.reward_budget() == budget - 4 * SETTINGS.reward_per_unit
    assert pools.admin.get_node(node.address).accepted_units == 5
    assert pools.admin.get_work(invalidated).status is WorkStatus.HARD_INVALIDATED
    # The single call stays strict: a known key is an error there.
    for key in (recorded, invalidated, fresh):
        with pytest.raises(ChainError) as exc:
            pools.validator.record_work(node.address, key, 1)
        assert exc.value.reason == "DuplicateWorkKey"


def test_get_work_tells_a_reporter_what_is_done(pools: Pools) -> None:
    node = pools.new_node()
    unknown, accepted, claimed, soft, hard = (work_key() for _ in range(5))
    pools.validator.record_work_batch([(node.address, accepted, 1), (node.address, claimed, 1),
                                       (node.address, soft, 1)])
    pools.validator.invalidate_soft(node.address, soft, 1)
    pools.chain.advance_time(SETTINGS.reward_lock_period)
    pools.operator.claim_rewards(node.address, [claimed])
    pools.validator.invalidate_hard(node.address, hard, 1, EVIDENCE)
    seen = {key: pools.admin.get_work(key) for key in (unknown, accepted, claimed, soft, hard)}
    assert {key: (w.status, w.known, w.was_recorded, w.invalidated) for key, w in seen.items()} == {
        unknown: (WorkStatus.NONE, False, False, False),
        accepted: (WorkStatus.ACCEPTED, True, True, False),
        claimed: (WorkStatus.CLAIMED, True, True, False),
        soft: (WorkStatus.SOFT_INVALIDATED, True, True, True),
        hard: (WorkStatus.HARD_INVALIDATED, True, False, True),
    }
    assert int(seen[unknown].node, 16) == 0
    assert {seen[k].node for k in (accepted, claimed, soft, hard)} == {node.address}


def test_invalidation_batches_are_a_validators_all_or_nothing_and_skip_what_is_done(pools: Pools) -> None:
    """Issue 35 item 3: `invalidateSoftBatch` / `invalidateHardBatch` (the reporter's one transaction per batch)."""
    node, other = pools.new_node(), pools.new_node()
    soft, hard, taken = work_key(), work_key(), work_key()
    for client in (pools.stranger, pools.operator, pools.trainer):
        with pytest.raises(ChainError) as exc:
            client.invalidate_soft_batch([(node.address, soft, 1)])
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
        with pytest.raises(ChainError) as exc:
            client.invalidate_hard_batch([(node.address, hard, 1, EVIDENCE)])
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
    for call in (lambda: pools.validator.invalidate_soft_batch([]),
                 lambda: pools.validator.invalidate_hard_batch([])):
        with pytest.raises(ChainError) as exc:
            call()
        assert exc.value.reason == "BadParameters"
    pools.validator.record_work(other.address, taken, 5)
    with pytest.raises(ChainError) as exc:  # one bad item reverts the batch: nothing of it changed
        pools.validator.invalidate_soft_batch([(node.address, soft, 1), (node.address, taken, 1)])
    assert exc.value.reason == "WorkOfOtherNode"
    assert pools.admin.get_work(soft).status is WorkStatus.NONE
    pools.validator.invalidate_soft_batch([(node.address, soft, 1)])
    pools.validator.invalidate_soft_batch([(node.address, soft, 1)])  # resent: skipped
    assert pools.admin.get_work(soft).status is WorkStatus.SOFT_INVALIDATED
    pools.validator.invalidate_hard_batch([(node.address, hard, 1, EVIDENCE), (node.address, hard, 1, EVIDENCE)])
    assert pools.admin.get_work(hard).status is WorkStatus.HARD_INVALIDATED
    assert pools.admin.get_node(node.address).stake == SETTINGS.min_stake - SETTINGS.slash_penalty  # once
    with pytest.raises(ChainError) as exc:
        pools.validator.invalidate_hard_batch([(node.address, work_key(), 1, bytes(32))])
    assert exc.value.reason == "ZeroEvidenceHash"
