"""One anvil per test session; each test runs inside an evm_snapshot that is reverted afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from eth_utils import keccak

from contracts.deployment import Deployment, PoolSettings, deploy_pool
from contracts.devchain import DevChain
from contracts.pool import PoolClient, TokenClient
from contracts.transactor import Transactor, connect
from protocol.identity import Identity

TOKEN = 10**18
SETTINGS = PoolSettings(
    min_stake=10 * TOKEN,
    unbonding_period=300,
    invalidation_window=100,
    reward_lock_period=200,
    reward_per_unit=10**15,
    slash_penalty=4 * TOKEN,
    appeal_window=150,
)
BUDGET = 1000 * TOKEN

# PUBLIC anvil dev accounts by role (indices into the well-known test mnemonic).
ADMIN, VALIDATOR, TRAINER, OPERATOR, OPERATOR2, STRANGER, ATTACKER_EOA, VALIDATOR2, TREASURY = 0, 1, 2, 3, 4, 5, 6, 7, 9
# VALIDATOR2 holds no role at deploy time: a test that needs a second validator (appeals) grants it.


@pytest.fixture(scope="session")
def devchain() -> Iterator[DevChain]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with DevChain.start() as chain:
        yield chain


@pytest.fixture(scope="session")
def deployment(devchain: DevChain) -> Deployment:
    admin = devchain.account(ADMIN)
    tx = Transactor(connect(devchain.rpc_url), admin)
    return deploy_pool(
        tx,
        treasury=devchain.account(TREASURY).address,
        settings=SETTINGS,
        validators=[devchain.account(VALIDATOR).address],
        trainers=[devchain.account(TRAINER).address],
        mint={devchain.account(i).address: 1000 * TOKEN for i in (ADMIN, OPERATOR, OPERATOR2, STRANGER)},
        fund_rewards=BUDGET,
    )


@dataclass
class Pools:
    """Fresh clients (fresh nonce caches) for each role, inside one test's snapshot."""

    chain: DevChain
    deployment: Deployment
    admin: PoolClient
    validator: PoolClient
    trainer: PoolClient
    operator: PoolClient
    operator2: PoolClient
    stranger: PoolClient

    def client(self, index: int) -> PoolClient:
        return PoolClient(connect(self.chain.rpc_url), self.deployment.pool, self.chain.account(index))

    def token(self, index: int = ADMIN) -> TokenClient:
        return TokenClient(connect(self.chain.rpc_url), self.deployment.token, self.chain.account(index))

    def new_node(self, operator: PoolClient | None = None, stake: int = SETTINGS.min_stake) -> Identity:
        node = Identity.create()
        (operator or self.operator).register(node, stake)
        return node

    def work_key(self, run_id: str, node: str, version: int, counter: int) -> bytes:
        """`protocol.seeds.work_key` of an assignment in this deployment's pool and chain."""
        from protocol.seeds import work_key

        return work_key(run_id, node, version, counter, chain_id=self.deployment.chain_id, pool=self.deployment.pool)


@pytest.fixture
def pools(devchain: DevChain, deployment: Deployment) -> Iterator[Pools]:
    snapshot = devchain.snapshot()
    p = Pools(devchain, deployment, *(PoolClient(connect(devchain.rpc_url), deployment.pool, devchain.account(i))
                                      for i in (ADMIN, VALIDATOR, TRAINER, OPERATOR, OPERATOR2, STRANGER)))
    try:
        yield p
    finally:
        devchain.revert(snapshot)


_counter = iter(range(1, 1 << 30))


def work_key() -> bytes:
    """A fresh submission hash."""
    return keccak(text=f"submission-{next(_counter)}")
