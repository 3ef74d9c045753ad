"""One anvil per test session; each test runs inside an evm_snapshot that is reverted afterwards. The pool's
settings, role accounts and `Pools` are `bench.loopback`'s (the attack bench deploys the same pool); the tests
import them from here or from there."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from eth_utils import keccak

from bench.loopback import (
    ADMIN,
    ATTACKER_EOA,
    BUDGET,
    OPERATOR,
    OPERATOR2,
    SETTINGS,
    STRANGER,
    TOKEN,
    TRAINER,
    TREASURY,
    VALIDATOR,
    VALIDATOR2,
    Pools,
)
from contracts.deployment import Deployment, deploy_pool
from contracts.devchain import DevChain
from contracts.pool import PoolClient
from contracts.transactor import Transactor, connect

__all__ = ["ADMIN", "ATTACKER_EOA", "BUDGET", "OPERATOR", "OPERATOR2", "SETTINGS", "STRANGER", "TOKEN", "TRAINER",
           "TREASURY", "VALIDATOR", "VALIDATOR2", "Pools", "deployment", "devchain", "pools", "work_key"]


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
