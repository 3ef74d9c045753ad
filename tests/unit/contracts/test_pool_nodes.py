"""Registration, stake, leaving and withdrawal against a real anvil."""

from __future__ import annotations

import time

import pytest
from chainfixtures import SETTINGS, STRANGER, TOKEN, Pools

from contracts.pool import NodeStatus, registration_typed_data
from protocol.errors import ChainError
from protocol.identity import Identity, recover_typed_data


def _reason(exc: pytest.ExceptionInfo[ChainError]) -> str | None:
    return exc.value.reason


def test_register_moves_stake_and_emits(pools: Pools) -> None:
    op = pools.operator
    before = op.token.balance_of(op.identity.address)
    node = Identity.create()
    receipt = op.register(node, 12 * TOKEN)
    info = op.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.operator == op.identity.address
    assert info.stake == 12 * TOKEN and info.nonce == 1
    assert op.token.balance_of(op.identity.address) == before - 12 * TOKEN
    assert op.total_stake() == 12 * TOKEN and op.is_active(node.address)
    events = op.events(receipt.block_number, names={"NodeRegistered"})
    assert [(e.args["node"], e.args["operator"], e.args["stake"]) for e in events] == [
        (node.address, op.identity.address, 12 * TOKEN)
    ]


def test_registration_signature_is_the_python_typed_data(pools: Pools) -> None:
    """The contract's EIP-712 domain equals the one the Python side signs (same digest, same signer)."""
    op = pools.operator
    node = Identity.create()
    message = registration_typed_data(chain_id=31337, pool=op.address, node=node.address,
                                      operator=op.identity.address, nonce=0, deadline=123)
    sig = node.sign_typed_data(message)
    assert recover_typed_data(message, sig) == node.address
    from eth_account.messages import encode_typed_data
    assert encode_typed_data(full_message=message).header == op.domain_separator()


def test_forged_node_signatures_are_refused(pools: Pools) -> None:
    op, other = pools.operator, pools.operator2
    node = Identity.create()
    deadline = int(time.time()) + 600
    op.token.approve(op.address, 100 * TOKEN)
    # Signed by some other key than the node's.
    forged = pools.operator.registration_signature(Identity.create(), op.identity.address, deadline, nonce=0)
    with pytest.raises(ChainError) as exc:
        op.register_signed(node.address, SETTINGS.min_stake, deadline, forged)
    assert _reason(exc) == "InvalidNodeSignature"
    # The node signed for operator2: operator cannot use it (front-running a registration).
    for_other = op.registration_signature(node, other.identity.address, deadline)
    with pytest.raises(ChainError) as exc:
        op.register_signed(node.address, SETTINGS.min_stake, deadline, for_other)
    assert _reason(exc) == "InvalidNodeSignature"
    # Signed for another pool address (another run): domain differs.
    message = registration_typed_data(chain_id=31337, pool=op.token.address, node=node.address,
                                      operator=op.identity.address, nonce=0, deadline=deadline)
    with pytest.raises(ChainError) as exc:
        op.register_signed(node.address, SETTINGS.min_stake, deadline, node.sign_typed_data(message))
    assert _reason(exc) == "InvalidNodeSignature"
    # Garbage bytes and a truncated signature.
    for bad in (b"\x01" * 65, b"\x02" * 64, b""):
        with pytest.raises(ChainError) as exc:
            op.register_signed(node.address, SETTINGS.min_stake, deadline, bad)
        assert _reason(exc) == "InvalidNodeSignature"
    # A signature with a different deadline than submitted.
    good = op.registration_signature(node, op.identity.address, deadline)
    with pytest.raises(ChainError) as exc:
        op.register_signed(node.address, SETTINGS.min_stake, deadline + 1, good)
    assert _reason(exc) == "InvalidNodeSignature"
    op.register_signed(node.address, SETTINGS.min_stake, deadline, good)
    assert op.get_node(node.address).status is NodeStatus.ACTIVE


def test_register_reverts(pools: Pools) -> None:
    op = pools.operator
    node = Identity.create()
    now = pools.chain.web3().eth.get_block("latest")["timestamp"]
    with pytest.raises(ChainError) as exc:
        op.register(node, SETTINGS.min_stake, deadline=now - 1)
    assert _reason(exc) == "SignatureExpired"
    with pytest.raises(ChainError) as exc:
        op.register(node, SETTINGS.min_stake - 1)
    assert _reason(exc) == "StakeBelowMinimum"
    op.register(node, SETTINGS.min_stake)
    with pytest.raises(ChainError) as exc:
        pools.operator2.register(node, SETTINGS.min_stake)
    assert _reason(exc) == "NodeAlreadyRegistered"
    # Not enough allowance: the token's own error comes back as the reason.
    with pytest.raises(ChainError) as exc:
        pools.stranger.register(Identity.create(), SETTINGS.min_stake, approve=False)
    assert _reason(exc) == "ERC20InsufficientAllowance"


def test_add_stake(pools: Pools) -> None:
    node = pools.new_node()
    receipt = pools.operator.add_stake(node.address, 3 * TOKEN)
    assert pools.operator.get_node(node.address).stake == SETTINGS.min_stake + 3 * TOKEN
    (event,) = pools.operator.events(receipt.block_number, names={"StakeAdded"})
    assert event.args["total"] == SETTINGS.min_stake + 3 * TOKEN
    with pytest.raises(ChainError) as exc:
        pools.stranger.add_stake(node.address, TOKEN)
    assert _reason(exc) == "NotOperator"
    with pytest.raises(ChainError) as exc:
        pools.operator.add_stake(node.address, 0)
    assert _reason(exc) == "BadParameters"
    pools.operator.leave_pool(node.address)
    with pytest.raises(ChainError) as exc:
        pools.operator.add_stake(node.address, TOKEN)
    assert _reason(exc) == "NodeNotActive"


def test_leave_unbond_withdraw_and_register_again(pools: Pools) -> None:
    op = pools.operator
    node = pools.new_node()
    balance = op.token.balance_of(op.identity.address)
    with pytest.raises(ChainError) as exc:
        op.withdraw(node.address)
    assert _reason(exc) == "NotUnbonding"
    with pytest.raises(ChainError) as exc:
        pools.stranger.leave_pool(node.address)
    assert _reason(exc) == "NotOperator"
    receipt = op.leave_pool(node.address)
    info = op.get_node(node.address)
    assert info.status is NodeStatus.LEAVING and info.unbonding_end > 0
    (event,) = op.events(receipt.block_number, names={"LeaveStarted"})
    assert event.args["unbondingEnd"] == info.unbonding_end
    with pytest.raises(ChainError) as exc:
        op.leave_pool(node.address)
    assert _reason(exc) == "NodeNotActive"
    with pytest.raises(ChainError) as exc:
        op.withdraw(node.address)
    assert _reason(exc) == "StillUnbonding"
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    with pytest.raises(ChainError) as exc:
        pools.stranger.withdraw(node.address)
    assert _reason(exc) == "NotOperator"
    receipt = op.withdraw(node.address)
    assert op.token.balance_of(op.identity.address) == balance + SETTINGS.min_stake
    assert op.total_stake() == 0
    assert op.get_node(node.address).status is NodeStatus.NONE
    (event,) = op.events(receipt.block_number, names={"StakeWithdrawn"})
    assert event.args["amount"] == SETTINGS.min_stake
    with pytest.raises(ChainError) as exc:
        op.withdraw(node.address)
    assert _reason(exc) == "NotUnbonding"
    # The old signature (nonce 0) cannot be replayed; a fresh one (nonce 1) registers the key again.
    deadline = int(time.time()) + 3600
    old = op.registration_signature(node, op.identity.address, deadline, nonce=0)
    with pytest.raises(ChainError) as exc:
        op.register_signed(node.address, SETTINGS.min_stake, deadline, old)
    assert _reason(exc) == "InvalidNodeSignature"
    pools.client(STRANGER).register(node, SETTINGS.min_stake)
    info = op.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.nonce == 2
