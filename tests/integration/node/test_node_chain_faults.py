"""The node's own transactions on a chain that drops them (issue 26 item 5): staking (register), claiming and
appealing go through the node's chain client with its default transactor; a dropped transaction is sent again and the
stake is taken, the reward paid, the appeal filed, exactly once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from chainfaults import Background, manual_mining, nonce, pending, wait_for
from chainfixtures import OPERATOR, SETTINGS, Pools, work_key

from contracts.pool import EscrowStatus, NodeStatus, WorkStatus
from node import commands
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


def _through_a_drop(pools: Pools, sender: str, send: Callable[[], object]) -> None:
    """Run `send` while the chain mines only on request: drop its transaction once, then mine the resend."""
    chain = pools.chain
    before = nonce(chain, sender)
    with manual_mining(chain):
        job = Background(send)
        wait_for(lambda: len(pending(chain, sender)) == 1, "the transaction in the pool")
        chain.rpc("anvil_dropAllTransactions")
        wait_for(lambda: len(pending(chain, sender)) == 1, "the transaction sent again")
        chain.rpc("evm_mine")
        job.result()
    assert nonce(chain, sender) == before + 1  # one transaction landed


def test_node_stake_and_claim_survive_a_dropped_transaction(pools: Pools) -> None:
    chain = pools.chain
    operator = chain.account(OPERATOR)
    node_chain = commands.Chain(chain.web3(), chain.chain_id, pools.deployment.pool, 0)
    client = node_chain.client(operator)  # what `prime-node join` and `claim` send with
    node = Identity.create()
    stake = SETTINGS.min_stake
    client.token.approve(pools.deployment.pool, stake)
    tokens = client.token.balance_of(operator.address)

    _through_a_drop(pools, operator.address, lambda: client.register(node, stake, approve=False))
    info = client.get_node(node.address)
    assert info.status is NodeStatus.ACTIVE and info.stake == stake  # staked once
    assert client.token.balance_of(operator.address) == tokens - stake

    key = work_key()
    pools.validator.record_work(node.address, key, 5)
    chain.advance_time(SETTINGS.reward_lock_period + 1)
    reward = client.get_work(key).reward
    assert reward > 0
    _through_a_drop(pools, operator.address, lambda: client.claim_rewards(node.address, [key]))
    assert client.get_work(key).status is WorkStatus.CLAIMED
    assert client.token.balance_of(operator.address) == tokens - stake + reward  # paid once


def test_node_appeal_survives_a_dropped_transaction(pools: Pools) -> None:
    chain = pools.chain
    operator = chain.account(OPERATOR)
    client = commands.Chain(chain.web3(), chain.chain_id, pools.deployment.pool, 0).client(operator)
    node = pools.new_node()
    key = work_key()
    pools.validator.invalidate_hard(node.address, key, 1, b"\x01" * 32)
    assert client.get_escrow(key).status is EscrowStatus.HELD
    _through_a_drop(pools, operator.address, lambda: client.appeal(key))
    assert client.get_escrow(key).status is EscrowStatus.APPEALED
    filed = [ev for ev in client.events(0, int(chain.web3().eth.block_number), names={"AppealFiled"})
             if bytes(ev.args["workKey"]) == key]
    assert len(filed) == 1
