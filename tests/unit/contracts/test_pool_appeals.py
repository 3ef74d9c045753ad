"""Appeals of hard invalidations: the slash is held in escrow until the appeal window closes; a node's operator
(or the node key) may appeal within it; a validator other than the slasher resolves the appeal. Won: stake,
work and reward back, the ejection undone once no hard verdict stands. Lost or late: the escrow goes to the
treasury. Never to a validator, never paid twice."""

from __future__ import annotations

import pytest
from chainfixtures import BUDGET, SETTINGS, TOKEN, TREASURY, VALIDATOR2, Pools, work_key
from eth_utils import keccak

from contracts.pool import EscrowStatus, NodeStatus, PoolClient, WorkStatus
from protocol.errors import ChainError
from protocol.identity import Identity

EVIDENCE = keccak(text="validator A: logprob off by 1e-6 (tolerance 0)")
RECHECK = keccak(text="validator B: passes the appeal thresholds")


def _second_validator(pools: Pools) -> PoolClient:
    pools.admin.grant_role("validator", pools.chain.account(VALIDATOR2).address)
    return pools.client(VALIDATOR2)


def _reason(call) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ChainError) as exc:
        call()
    return str(exc.value.reason)


def test_a_slash_is_held_in_escrow_then_released_to_the_treasury_when_nobody_appeals(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    token = pools.token()
    treasury = pools.chain.account(TREASURY).address
    before = {a: token.balance_of(a) for a in (treasury, pools.validator.identity.address)}

    receipt = pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)

    now = pools.admin.pool_time()
    escrow = pools.admin.get_escrow(key)
    assert (escrow.slasher, escrow.status, escrow.amount) == (
        pools.validator.identity.address, EscrowStatus.HELD, SETTINGS.slash_penalty)
    assert escrow.appeal_deadline == now + SETTINGS.appeal_window
    assert pools.admin.total_escrow() == SETTINGS.slash_penalty
    assert pools.admin.total_stake() == SETTINGS.min_stake - SETTINGS.slash_penalty
    assert {a: token.balance_of(a) for a in before} == before  # nothing paid out yet, to anyone
    events = {e.name: e.args for e in pools.admin.events(receipt.block_number)}
    assert events["SlashEscrowed"] == {"node": node.address, "workKey": key, "amount": SETTINGS.slash_penalty,
                                       "appealDeadline": escrow.appeal_deadline}
    assert events["StakeSlashed"]["amount"] == SETTINGS.slash_penalty

    assert _reason(lambda: pools.stranger.release_escrow(key)) == "AppealWindowOpen"
    pools.chain.advance_time(SETTINGS.appeal_window + 1)
    assert _reason(lambda: pools.operator.appeal(key)) == "AppealWindowClosed"  # a late appeal
    receipt = pools.stranger.release_escrow(key)  # anyone may release it
    assert token.balance_of(treasury) == before[treasury] + SETTINGS.slash_penalty
    assert token.balance_of(pools.validator.identity.address) == before[pools.validator.identity.address]
    assert pools.admin.get_escrow(key).status is EscrowStatus.RELEASED and pools.admin.total_escrow() == 0
    (event,) = pools.admin.events(receipt.block_number, names={"EscrowReleased"})
    assert event.args == {"node": node.address, "workKey": key, "treasury": treasury,
                          "amount": SETTINGS.slash_penalty}
    assert _reason(lambda: pools.stranger.release_escrow(key)) == "WrongEscrowStatus"  # paid once
    assert _reason(lambda: pools.operator.appeal(key)) == "WrongEscrowStatus"


def test_a_won_appeal_returns_the_stake_restores_the_work_and_undoes_the_ejection(pools: Pools) -> None:
    v2 = _second_validator(pools)
    node = pools.new_node(stake=SETTINGS.min_stake + TOKEN)
    key = work_key()
    pools.validator.record_work(node.address, key, 10)
    recorded_at = pools.admin.get_work(key).recorded_at
    token = pools.token()
    watched = (pools.chain.account(TREASURY).address, pools.validator.identity.address, v2.identity.address)
    before = {a: token.balance_of(a) for a in watched}
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    assert pools.admin.get_node(node.address).status is NodeStatus.EJECTED
    assert pools.admin.rewards_reserved() == 0 and pools.admin.reward_budget() == BUDGET

    # only the node's operator (or the node key) may appeal
    assert _reason(lambda: pools.stranger.appeal(key)) == "NotOperator"
    assert _reason(lambda: v2.appeal(key)) == "NotOperator"
    assert _reason(lambda: v2.resolve_appeal(key, False, 0, RECHECK)) == "WrongEscrowStatus"  # nothing filed
    receipt = pools.operator.appeal(key)
    (event,) = pools.admin.events(receipt.block_number, names={"AppealFiled"})
    assert event.args == {"node": node.address, "workKey": key, "appellant": pools.operator.identity.address}
    assert pools.admin.get_escrow(key).status is EscrowStatus.APPEALED
    assert _reason(lambda: pools.operator.appeal(key)) == "WrongEscrowStatus"  # once
    pools.chain.advance_time(SETTINGS.appeal_window + 1)  # resolving may take longer than the window
    assert _reason(lambda: pools.stranger.release_escrow(key)) == "WrongEscrowStatus"  # held while appealed

    # the slasher never judges its own verdict; nor does anyone without the role
    assert _reason(lambda: pools.validator.resolve_appeal(key, False, 0, RECHECK)) == "ResolverIsSlasher"
    assert _reason(lambda: pools.operator.resolve_appeal(key, False, 0, RECHECK)) == \
        "AccessControlUnauthorizedAccount"
    assert _reason(lambda: v2.resolve_appeal(key, False, 0, bytes(32))) == "ZeroEvidenceHash"
    receipt = v2.resolve_appeal(key, False, 0, RECHECK)

    info = pools.admin.get_node(node.address)
    assert (info.status, info.stake, info.unbonding_end, info.accepted_units) == (
        NodeStatus.ACTIVE, SETTINGS.min_stake + TOKEN, 0, 10)
    work = pools.admin.get_work(key)
    assert (work.status, work.units, work.reward, work.recorded_at) == (
        WorkStatus.ACCEPTED, 10, 10 * SETTINGS.reward_per_unit, recorded_at)
    assert pools.admin.rewards_reserved() == 10 * SETTINGS.reward_per_unit
    assert pools.admin.reward_budget() == BUDGET - 10 * SETTINGS.reward_per_unit
    assert pools.admin.total_escrow() == 0 and pools.admin.total_stake() == SETTINGS.min_stake + TOKEN
    assert pools.admin.get_escrow(key).status is EscrowStatus.OVERTURNED
    assert {a: token.balance_of(a) for a in watched} == before  # no validator, nor the treasury, got anything
    names = [e.name for e in pools.admin.events(receipt.block_number)]
    assert names == ["AppealResolved", "SlashReversed", "WorkRestored", "NodeReinstated"]
    events = {e.name: e.args for e in pools.admin.events(receipt.block_number)}
    assert events["AppealResolved"] == {"node": node.address, "workKey": key, "validator": v2.identity.address,
                                        "upheld": False, "evidenceHash": RECHECK}
    assert events["SlashReversed"]["amount"] == SETTINGS.slash_penalty
    assert events["NodeReinstated"]["status"] == NodeStatus.ACTIVE

    # settled once: not resolved again, not invalidated again, paid once
    assert _reason(lambda: v2.resolve_appeal(key, True, 0, RECHECK)) == "WrongEscrowStatus"
    assert pools.validator.record_work(node.address, work_key(), 1)  # active again: takes work
    pools.chain.advance_time(SETTINGS.reward_lock_period)
    paid_before = token.balance_of(pools.operator.identity.address)
    pools.operator.claim_rewards(node.address, [key])  # unlocked on its original recording time
    assert token.balance_of(pools.operator.identity.address) == paid_before + 10 * SETTINGS.reward_per_unit
    assert _reason(lambda: pools.operator.claim_rewards(node.address, [key])) == "WorkNotAccepted"


def test_an_overturned_key_that_was_never_recorded_is_recorded_with_the_resolvers_units(pools: Pools) -> None:
    v2 = _second_validator(pools)
    node = pools.new_node()
    key = work_key()
    pools.validator.invalidate_hard(node.address, key, 21, EVIDENCE)
    # the node key itself may appeal (it needs gas)
    pools.chain.rpc("anvil_setBalance", [node.address, hex(10**18)])
    PoolClient(pools.admin.w3, pools.deployment.pool, node).appeal(key)
    assert _reason(lambda: v2.resolve_appeal(key, False, 0, RECHECK)) == "ZeroUnits"
    v2.resolve_appeal(key, False, 7, RECHECK)
    work = pools.admin.get_work(key)
    assert (work.status, work.units, work.reward) == (WorkStatus.ACCEPTED, 7, 7 * SETTINGS.reward_per_unit)
    assert work.recorded_at == pools.admin.pool_time()  # its reward lock starts now
    assert _reason(lambda: pools.operator.claim_rewards(node.address, [key])) == "RewardLocked"
    # inside the invalidation window again, yet cleared by the appeal for good
    assert _reason(lambda: pools.validator.invalidate_hard(node.address, key, 21, EVIDENCE)) == "WorkCleared"
    assert _reason(lambda: pools.validator.invalidate_soft(node.address, key, 3)) == "WorkCleared"
    assert pools.admin.get_node(node.address).status is NodeStatus.ACTIVE


def test_a_lost_appeal_pays_the_treasury_and_the_node_stays_ejected(pools: Pools) -> None:
    v2 = _second_validator(pools)
    node = pools.new_node()
    key = work_key()
    token = pools.token()
    treasury = pools.chain.account(TREASURY).address
    before = token.balance_of(treasury)
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    pools.operator.appeal(key)
    receipt = v2.resolve_appeal(key, True, 0, RECHECK)
    assert token.balance_of(treasury) == before + SETTINGS.slash_penalty
    assert pools.admin.get_escrow(key).status is EscrowStatus.UPHELD and pools.admin.total_escrow() == 0
    info = pools.admin.get_node(node.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake - SETTINGS.slash_penalty
    assert pools.admin.get_work(key).status is WorkStatus.HARD_INVALIDATED
    assert [e.name for e in pools.admin.events(receipt.block_number)] == ["AppealResolved", "EscrowReleased"]
    assert _reason(lambda: pools.stranger.release_escrow(key)) == "WrongEscrowStatus"  # paid once


def test_appeal_refusals(pools: Pools) -> None:
    node = pools.new_node()
    soft = work_key()
    pools.validator.invalidate_soft(node.address, soft, 3)
    assert _reason(lambda: pools.operator.appeal(soft)) == "NotSlashed"  # nothing was slashed
    assert _reason(lambda: pools.operator.appeal(work_key())) == "NotSlashed"
    assert _reason(lambda: pools.stranger.release_escrow(soft)) == "WrongEscrowStatus"


def test_the_ejection_is_undone_only_when_every_hard_verdict_is_overturned(pools: Pools) -> None:
    v2 = _second_validator(pools)
    leaving = pools.new_node(stake=SETTINGS.min_stake + 3 * TOKEN)
    pools.operator.leave_pool(leaving.address)
    unbonding_end = pools.admin.get_node(leaving.address).unbonding_end
    first, second = work_key(), work_key()
    pools.validator.invalidate_hard(leaving.address, first, 17, EVIDENCE)
    pools.validator.invalidate_hard(leaving.address, second, 17, EVIDENCE)
    pools.operator.appeal(first)
    pools.operator.appeal(second)
    v2.resolve_appeal(first, False, 2, RECHECK)
    assert pools.admin.get_node(leaving.address).status is NodeStatus.EJECTED  # the second verdict stands
    v2.resolve_appeal(second, False, 2, RECHECK)
    info = pools.admin.get_node(leaving.address)
    assert (info.status, info.unbonding_end, info.stake) == (
        NodeStatus.LEAVING, unbonding_end, SETTINGS.min_stake + 3 * TOKEN)  # back to leaving, as it was


def test_an_ejected_node_that_withdrew_gets_its_escrow_back_but_is_not_reinstated(pools: Pools) -> None:
    v2 = _second_validator(pools)
    node = pools.new_node(stake=SETTINGS.min_stake + TOKEN)
    key = work_key()
    token = pools.token()
    operator = pools.operator.identity.address
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    pools.operator.appeal(key)
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    pools.operator.withdraw(node.address)  # took the rest and went
    v2.resolve_appeal(key, False, 3, RECHECK)
    info = pools.admin.get_node(node.address)
    assert (info.status, info.stake) == (NodeStatus.EJECTED, SETTINGS.slash_penalty)
    before = token.balance_of(operator)
    pools.operator.withdraw(node.address)  # the returned escrow, at once
    assert token.balance_of(operator) == before + SETTINGS.slash_penalty
    assert pools.admin.total_stake() == 0 and pools.admin.total_escrow() == 0


def test_an_appeal_cannot_be_filed_for_someone_elses_node_by_its_key(pools: Pools) -> None:
    node, other = pools.new_node(), pools.new_node(operator=pools.operator2)
    key = work_key()
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    assert _reason(lambda: pools.operator2.appeal(key)) == "NotOperator"  # an operator, but not of this node
    stranger_key = Identity.create()
    pools.chain.rpc("anvil_setBalance", [stranger_key.address, hex(10**18)])
    assert _reason(lambda: PoolClient(pools.admin.w3, pools.deployment.pool, stranger_key).appeal(key)) == \
        "NotOperator"
    assert pools.admin.get_node(other.address).status is NodeStatus.ACTIVE


def test_an_appeal_nobody_resolves_lapses_and_the_slash_stands(pools: Pools) -> None:
    """Issue 23 item 13: an appealed escrow no longer waits forever. Unresolved a whole `appealWindow` after it was
    filed, anyone may let it lapse: the slash stands (a validator can only resolve what the node sends it, so
    "file, then stay silent" must not be a way out of a slash), paid to the treasury once."""
    v2 = _second_validator(pools)
    node = pools.new_node()
    key = work_key()
    token = pools.token()
    treasury = pools.chain.account(TREASURY).address
    before = token.balance_of(treasury)
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    assert pools.admin.get_escrow(key).resolve_deadline == 0
    assert _reason(lambda: pools.stranger.lapse_appeal(key)) == "WrongEscrowStatus"  # not appealed
    pools.operator.appeal(key)
    escrow = pools.admin.get_escrow(key)
    assert escrow.resolve_deadline == pools.admin.pool_time() + SETTINGS.appeal_window
    assert _reason(lambda: pools.stranger.lapse_appeal(key)) == "AppealStillOpen"
    pools.chain.advance_time(SETTINGS.appeal_window + 1)
    receipt = pools.stranger.lapse_appeal(key)
    assert [e.name for e in pools.admin.events(receipt.block_number)] == ["AppealLapsed", "EscrowReleased"]
    assert pools.admin.get_escrow(key).status is EscrowStatus.LAPSED and pools.admin.total_escrow() == 0
    assert token.balance_of(treasury) == before + SETTINGS.slash_penalty
    assert pools.admin.get_node(node.address).status is NodeStatus.EJECTED
    # settled: neither resolved late nor lapsed twice
    assert _reason(lambda: v2.resolve_appeal(key, False, 0, RECHECK)) == "WrongEscrowStatus"
    assert _reason(lambda: pools.stranger.lapse_appeal(key)) == "WrongEscrowStatus"


def test_a_one_validator_pool_resolves_appeals_of_its_own_verdicts(pools: Pools) -> None:
    """Issue 23 item 13: with one validator there is no second opinion to wait for; the only validator re-checks
    its own verdict (with the intake thresholds). Once a second validator exists, the slasher may not."""
    assert pools.admin.validator_count() == 1
    node = pools.new_node()
    key = work_key()
    pools.validator.invalidate_hard(node.address, key, 17, EVIDENCE)
    pools.operator.appeal(key)
    pools.validator.resolve_appeal(key, False, 10, RECHECK)
    assert pools.admin.get_escrow(key).status is EscrowStatus.OVERTURNED
    assert pools.admin.get_work(key).status is WorkStatus.ACCEPTED

    v2 = _second_validator(pools)
    assert pools.admin.validator_count() == 2
    other = pools.new_node()
    key2 = work_key()
    pools.validator.invalidate_hard(other.address, key2, 17, EVIDENCE)
    pools.operator.appeal(key2)
    assert _reason(lambda: pools.validator.resolve_appeal(key2, True, 0, RECHECK)) == "ResolverIsSlasher"
    pools.admin.revoke_role("validator", v2.identity.address)
    pools.admin.grant_role("validator", v2.identity.address)
    pools.admin.grant_role("validator", v2.identity.address)  # granting twice counts once
    assert pools.admin.validator_count() == 2
    pools.admin.revoke_role("validator", v2.identity.address)
    assert pools.admin.validator_count() == 1
    pools.validator.resolve_appeal(key2, True, 0, RECHECK)
    assert pools.admin.get_escrow(key2).status is EscrowStatus.UPHELD
