"""Roles, parameters, the reward budget, policy publication and pausing."""

from __future__ import annotations

import pytest
from chainfixtures import BUDGET, SETTINGS, TOKEN, TREASURY, Pools, work_key
from eth_utils import keccak

from contracts.pool import DEFAULT_ADMIN_ROLE
from protocol.errors import ChainError
from protocol.identity import Identity

MANIFEST = keccak(text="manifest of step 1")


def test_deployment_state(pools: Pools) -> None:
    params = pools.admin.params()
    d = pools.deployment
    assert params.token == d.token and params.treasury == d.treasury == pools.chain.account(TREASURY).address
    assert (params.min_stake, params.unbonding_period, params.invalidation_window, params.reward_lock_period,
            params.reward_per_unit, params.slash_penalty) == (
        SETTINGS.min_stake, SETTINGS.unbonding_period, SETTINGS.invalidation_window,
        SETTINGS.reward_lock_period, SETTINGS.reward_per_unit, SETTINGS.slash_penalty)
    assert pools.admin.has_role("admin", d.deployer)
    assert pools.admin.has_role("validator", pools.validator.identity.address)
    assert pools.admin.has_role("trainer", pools.trainer.identity.address)
    assert not pools.admin.has_role("validator", pools.stranger.identity.address)
    assert pools.admin.reward_budget() == BUDGET and not pools.admin.paused()
    names = [e.name for e in pools.admin.events(d.start_block)]
    assert names.count("RoleGranted") == 3 and "RewardsFunded" in names


def test_roles_are_granted_and_revoked_by_admin_only(pools: Pools) -> None:
    newcomer = pools.stranger.identity.address
    with pytest.raises(ChainError) as exc:
        pools.validator.grant_role("validator", newcomer)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    receipt = pools.admin.grant_role("validator", newcomer)
    assert pools.admin.has_role("validator", newcomer)
    (event,) = pools.admin.events(receipt.block_number, names={"RoleGranted"})
    assert event.args["account"] == newcomer
    pools.admin.revoke_role("validator", newcomer)
    assert not pools.admin.has_role("validator", newcomer)
    node = pools.new_node()
    with pytest.raises(ChainError) as exc:
        pools.stranger.record_work(node.address, work_key(), 1)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    pools.trainer.renounce_role("trainer")
    assert not pools.admin.has_role("trainer", pools.trainer.identity.address)


def test_treasury_can_never_be_a_validator(pools: Pools) -> None:
    treasury = pools.admin.params().treasury
    with pytest.raises(ChainError) as exc:
        pools.admin.grant_role("validator", treasury)
    assert exc.value.reason == "TreasuryIsValidator"
    with pytest.raises(ChainError) as exc:
        pools.admin.set_treasury(pools.validator.identity.address)
    assert exc.value.reason == "TreasuryIsValidator"
    new = Identity.create().address
    receipt = pools.admin.set_treasury(new)
    assert pools.admin.params().treasury == new
    (event,) = pools.admin.events(receipt.block_number)
    assert (event.name, event.args) == ("TreasuryChanged", {"treasury": new})


def test_parameter_setters(pools: Pools) -> None:
    for call, event_name, value in (
        (pools.admin.set_min_stake, "MinStakeChanged", 20 * TOKEN),
        (pools.admin.set_reward_per_unit, "RewardPerUnitChanged", 7),
        (pools.admin.set_slash_penalty, "SlashPenaltyChanged", 3 * TOKEN),
    ):
        receipt = call(value)
        (event,) = pools.admin.events(receipt.block_number)
        assert event.name == event_name and list(event.args.values()) == [value]
    params = pools.admin.params()
    assert (params.min_stake, params.reward_per_unit, params.slash_penalty) == (20 * TOKEN, 7, 3 * TOKEN)
    with pytest.raises(ChainError) as exc:
        pools.admin.set_min_stake(0)
    assert exc.value.reason == "BadParameters"
    for call in (pools.validator.set_min_stake, pools.validator.set_reward_per_unit,
                 pools.validator.set_slash_penalty):
        with pytest.raises(ChainError) as exc:
            call(1)
        assert exc.value.reason == "AccessControlUnauthorizedAccount"
    with pytest.raises(ChainError) as exc:
        pools.stranger.set_treasury(pools.stranger.identity.address)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"


def test_bootstrap_peers_are_set_by_the_admin_within_caps(pools: Pools) -> None:
    assert pools.stranger.bootstrap_peers() == []
    peers = ["/ip4/10.0.0.5/tcp/4001/p2p/12D3KooWA", "/dns4/boot.example/tcp/4001/p2p/12D3KooWB"]
    receipt = pools.admin.set_bootstrap_peers(peers)
    (event,) = pools.admin.events(receipt.block_number)
    assert event.name == "BootstrapPeersSet" and event.args["count"] == 2
    assert pools.stranger.bootstrap_peers() == peers
    pools.admin.set_bootstrap_peers(peers[1:])  # replaced, not appended
    assert pools.stranger.bootstrap_peers() == peers[1:]
    for bad in (["/x"] * 17, [""], ["/" + "a" * 256]):
        with pytest.raises(ChainError) as exc:
            pools.admin.set_bootstrap_peers(bad)
        assert exc.value.reason == "BadParameters"
    with pytest.raises(ChainError) as exc:
        pools.validator.set_bootstrap_peers(peers)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    assert pools.stranger.bootstrap_peers() == peers[1:]


def test_publish_policy(pools: Pools) -> None:
    receipt = pools.trainer.publish_policy(1, MANIFEST)
    assert pools.admin.policy() == (1, MANIFEST)
    (event,) = pools.admin.events(receipt.block_number)
    assert event.name == "PolicyPublished" and event.args["version"] == 1 and event.args["manifestHash"] == MANIFEST
    with pytest.raises(ChainError) as exc:
        pools.trainer.publish_policy(1, keccak(text="other"))
    assert exc.value.reason == "PolicyVersionNotIncreasing"
    pools.trainer.publish_policy(5, keccak(text="step 5"))
    assert pools.admin.policy()[0] == 5
    with pytest.raises(ChainError) as exc:
        pools.validator.publish_policy(6, MANIFEST)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"


def test_policy_versions_never_go_back(pools: Pools) -> None:
    """A zero manifest hash used to reset "nothing published yet", after which any version was accepted."""
    with pytest.raises(ChainError) as exc:
        pools.trainer.publish_policy(11, bytes(32))
    assert exc.value.reason == "ZeroManifestHash"
    pools.trainer.publish_policy(11, MANIFEST)
    for version in (1, 11):
        with pytest.raises(ChainError) as exc:
            pools.trainer.publish_policy(version, keccak(text=f"step {version}"))
        assert exc.value.reason == "PolicyVersionNotIncreasing"
    with pytest.raises(ChainError) as exc:
        pools.trainer.publish_policy(12, bytes(32))
    assert exc.value.reason == "ZeroManifestHash"
    assert pools.admin.policy() == (11, MANIFEST)


def test_the_first_policy_version_may_be_zero(pools: Pools) -> None:
    pools.trainer.publish_policy(0, MANIFEST)
    assert pools.admin.policy() == (0, MANIFEST)
    with pytest.raises(ChainError) as exc:
        pools.trainer.publish_policy(0, keccak(text="again"))
    assert exc.value.reason == "PolicyVersionNotIncreasing"
    pools.trainer.publish_policy(1, keccak(text="step 1"))
    assert pools.admin.policy()[0] == 1


def test_fund_and_defund_rewards(pools: Pools) -> None:
    receipt = pools.stranger.fund_rewards(5 * TOKEN)
    assert pools.admin.reward_budget() == BUDGET + 5 * TOKEN
    (event,) = pools.admin.events(receipt.block_number, names={"RewardsFunded"})
    assert event.args == {"from": pools.stranger.identity.address, "amount": 5 * TOKEN, "budget": BUDGET + 5 * TOKEN}
    with pytest.raises(ChainError) as exc:
        pools.stranger.fund_rewards(0)
    assert exc.value.reason == "BadParameters"
    with pytest.raises(ChainError) as exc:
        pools.stranger.defund_rewards(pools.stranger.identity.address, TOKEN)
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    # Budget promised to recorded work cannot be taken back.
    node = pools.new_node()
    pools.validator.record_work(node.address, work_key(), 1000)
    available = pools.admin.reward_budget()
    with pytest.raises(ChainError) as exc:
        pools.admin.defund_rewards(pools.admin.identity.address, available + 1)
    assert exc.value.reason == "InsufficientRewardBudget"
    sink = Identity.create().address
    pools.admin.defund_rewards(sink, available)
    assert pools.admin.reward_budget() == 0 and pools.admin.token.balance_of(sink) == available
    assert pools.admin.rewards_reserved() == 1000 * SETTINGS.reward_per_unit


def test_paused_pool_refuses_every_state_change(pools: Pools) -> None:
    node = pools.new_node()
    key = work_key()
    pools.validator.record_work(node.address, key, 1)
    leaving = pools.new_node()
    pools.operator.leave_pool(leaving.address)
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    pools.operator.token.approve(pools.operator.address, 100 * TOKEN)
    with pytest.raises(ChainError) as exc:
        pools.stranger.pause()
    assert exc.value.reason == "AccessControlUnauthorizedAccount"
    receipt = pools.admin.pause()
    assert pools.admin.paused()
    assert [e.name for e in pools.admin.events(receipt.block_number)] == ["Paused"]
    blocked = [
        lambda: pools.operator.register(Identity.create(), SETTINGS.min_stake),
        lambda: pools.operator.add_stake(node.address, TOKEN),
        lambda: pools.operator.leave_pool(node.address),
        lambda: pools.operator.withdraw(leaving.address),
        lambda: pools.validator.record_work(node.address, work_key(), 1),
        lambda: pools.validator.invalidate_hard(node.address, work_key(), 1, key),
        lambda: pools.validator.invalidate_hard(node.address, key, 1, key),
        lambda: pools.validator.invalidate_soft(node.address, work_key(), 1),
        lambda: pools.validator.invalidate_soft(node.address, key, 1),
        lambda: pools.operator.claim_rewards(node.address, [key]),
        lambda: pools.trainer.publish_policy(1, key),
        lambda: pools.stranger.fund_rewards(TOKEN),
    ]
    for call in blocked:
        with pytest.raises(ChainError) as exc:
            call()
        assert exc.value.reason == "EnforcedPause"
    with pytest.raises(ChainError) as exc:
        pools.admin.pause()
    assert exc.value.reason == "EnforcedPause"
    pools.admin.unpause()
    pools.operator.withdraw(leaving.address)
    pools.operator.claim_rewards(node.address, [key])
    with pytest.raises(ChainError) as exc:
        pools.admin.unpause()
    assert exc.value.reason == "ExpectedPause"


def test_default_admin_role_constant(pools: Pools) -> None:
    assert pools.admin.contract.functions.DEFAULT_ADMIN_ROLE().call() == DEFAULT_ADMIN_ROLE
