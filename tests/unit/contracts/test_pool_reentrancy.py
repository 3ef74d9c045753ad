"""Reentrancy on withdraw and claim, through a token that calls the recipient back (ERC-777/1363 style).

A plain ERC-20 gives a receiver no control during a transfer, so the attack needs a token with hooks:
HookToken calls `onTokenReceived` on a receiving contract, and ReentrantOperator (the node's operator)
uses that moment to call the pool again. The pool must pay once and the re-entry must fail on the
reentrancy guard.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from chainfixtures import ATTACKER_EOA, SETTINGS, TOKEN, TREASURY, VALIDATOR, Pools, work_key

from contracts.artifacts import error_selector, load_artifact
from contracts.deployment import deploy_pool
from contracts.pool import NodeStatus, PoolClient, WorkStatus
from contracts.transactor import Transactor, connect
from protocol.identity import Identity

WITHDRAW, CLAIM = 1, 2


class Attack:
    def __init__(self, pools: Pools) -> None:
        chain = pools.chain
        w3 = connect(chain.rpc_url)
        self.admin_tx = Transactor(w3, chain.account(0))
        hook = load_artifact("HookToken")
        token, _ = self.admin_tx.deploy("HookToken", hook.abi, hook.bytecode)
        deployment = deploy_pool(self.admin_tx, token=token, treasury=chain.account(TREASURY).address,
                                 settings=SETTINGS, validators=[chain.account(VALIDATOR).address],
                                 mint={chain.account(0).address: 1000 * TOKEN}, fund_rewards=500 * TOKEN)
        self.pool = PoolClient(w3, deployment.pool, chain.account(0), self.admin_tx)
        self.validator = PoolClient(connect(chain.rpc_url), deployment.pool, chain.account(VALIDATOR))
        self.eoa = Transactor(w3, chain.account(ATTACKER_EOA))
        art = load_artifact("ReentrantOperator")
        address, _ = self.eoa.deploy("ReentrantOperator", art.abi, art.bytecode, deployment.pool, token)
        self.contract = w3.eth.contract(address=address, abi=art.abi)  # type: ignore[call-overload]
        self.token = self.pool.token
        self.token.mint(address, 100 * TOKEN)
        self.node = Identity.create()
        deadline = int(time.time()) + 3600
        sig = self.pool.registration_signature(self.node, address, deadline)
        self.send(self.contract.functions.register(self.node.address, SETTINGS.min_stake, deadline, sig))
        assert self.pool.get_node(self.node.address).operator == address

    @property
    def address(self) -> str:
        return str(self.contract.address)

    def send(self, fn: Any) -> None:
        self.eoa.send("attacker", {"to": self.address, "data": fn._encode_transaction_data(), "value": 0})

    def view(self, name: str) -> Any:
        return getattr(self.contract.functions, name)().call()

    def assert_blocked_once(self) -> None:
        assert self.view("reentryAttempts") == 1
        assert self.view("reentrySuccesses") == 0
        assert bytes(self.view("lastReentryError")) == error_selector("ReentrancyGuardReentrantCall")


@pytest.fixture
def attack(pools: Pools) -> Attack:
    return Attack(pools)


def test_reentrant_withdraw_is_blocked(pools: Pools, attack: Attack) -> None:
    attack.send(attack.contract.functions.leavePool())
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    pool_before = attack.token.balance_of(attack.pool.address)
    before = attack.token.balance_of(attack.address)
    attack.send(attack.contract.functions.arm(WITHDRAW, []))
    attack.send(attack.contract.functions.withdraw())
    attack.assert_blocked_once()
    assert attack.token.balance_of(attack.address) == before + SETTINGS.min_stake  # paid exactly once
    assert attack.token.balance_of(attack.pool.address) == pool_before - SETTINGS.min_stake
    assert attack.pool.get_node(attack.node.address).status is NodeStatus.NONE


def test_reentrant_claim_is_blocked(pools: Pools, attack: Attack) -> None:
    keys = [work_key(), work_key()]
    for key in keys:
        attack.validator.record_work(attack.node.address, key, 50)
    pools.chain.advance_time(SETTINGS.reward_lock_period + 1)
    before = attack.token.balance_of(attack.address)
    attack.send(attack.contract.functions.arm(CLAIM, keys))
    attack.send(attack.contract.functions.claim(keys))
    attack.assert_blocked_once()
    assert attack.token.balance_of(attack.address) == before + 100 * SETTINGS.reward_per_unit
    assert {attack.pool.get_work(k).status for k in keys} == {WorkStatus.CLAIMED}
    assert attack.pool.rewards_reserved() == 0


def test_cross_function_reentry_claim_into_withdraw_is_blocked(pools: Pools, attack: Attack) -> None:
    key = work_key()
    attack.validator.record_work(attack.node.address, key, 10)
    attack.send(attack.contract.functions.leavePool())
    pools.chain.advance_time(SETTINGS.unbonding_period + 1)
    before = attack.token.balance_of(attack.address)
    attack.send(attack.contract.functions.arm(WITHDRAW, []))
    attack.send(attack.contract.functions.claim([key]))
    attack.assert_blocked_once()
    assert attack.token.balance_of(attack.address) == before + 10 * SETTINGS.reward_per_unit
    assert attack.pool.get_node(attack.node.address).stake == SETTINGS.min_stake  # stake untouched
