"""Fixtures shared by the tiers that run roles against a chain (validator, node): one anvil per session
and a snapshot per test (the contracts tests' fixtures), policy v1 published, the tiny model, and a way
to serve validators on 127.0.0.1. Fixtures are only set up for the tests that ask for them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS / "unit" / "contracts"))

import chainfixtures  # noqa: E402
from chainfixtures import VALIDATOR, Pools  # noqa: E402

from bench.loopback import MANIFEST_V0, Served, serve, tiny, validator_config  # noqa: E402
from models.loading import LoadedModel  # noqa: E402

devchain, deployment, pools = chainfixtures.devchain, chainfixtures.deployment, chainfixtures.pools


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return tiny(0)


@pytest.fixture
def published(pools: Pools) -> Pools:
    """The pool with policy v1 published by the trainer."""
    pools.trainer.publish_policy(1, MANIFEST_V0)
    return pools


@pytest.fixture
def deployment_file(published: Pools, tmp_path: Path) -> Path:
    return published.deployment.save(tmp_path / "deployment.json")


@pytest.fixture
def make_validator(published: Pools, deployment_file: Path, tmp_path: Path) -> Iterator[object]:
    """`make(name="v", account=1, **config overrides)` serves a validator until the test ends (anvil
    account 1 holds the validator role; give another account the role before serving it)."""
    started: list[Served] = []

    def make(name: str = "v", account: int = VALIDATOR, port: int = 0, **overrides: object) -> Served:
        cfg = validator_config(tmp_path / name, deployment_file, published.chain.rpc_url, **overrides)
        served = serve(cfg, published.chain.account(account), port)
        started.append(served)
        return served

    yield make
    for s in started:
        s.stop()
