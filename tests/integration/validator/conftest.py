"""Fixtures: one anvil per session (the contracts tests' fixtures), a snapshot per test, the tiny model."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "contracts"))

import chainfixtures  # noqa: E402
from chainfixtures import VALIDATOR, Pools  # noqa: E402
from validator_harness import MANIFEST_V0, RUN, SimNode, serve, tiny, validator_config  # noqa: E402

from models.loading import LoadedModel  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.rollout import submission_domain  # noqa: E402

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
def validator_identity(pools: Pools) -> Identity:
    return pools.chain.account(VALIDATOR)


@pytest.fixture
def make_validator(published: Pools, validator_identity: Identity, tmp_path: Path) -> Iterator[object]:
    started = []

    def make(name: str = "v", **overrides: object):  # type: ignore[no-untyped-def]
        dep = tmp_path / "deployment.json"
        published.deployment.save(dep)
        cfg = validator_config(tmp_path / name, dep, published.chain.rpc_url, **overrides)
        served = serve(cfg, validator_identity)
        started.append(served)
        return served

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def make_node(published: Pools, tiny_model: LoadedModel):  # type: ignore[no-untyped-def]
    domain = submission_domain(published.deployment.chain_id, published.deployment.pool, RUN.run_id)

    def make(register: bool = True) -> SimNode:
        node = published.new_node() if register else Identity.create()
        return SimNode(node, tiny_model, domain)

    return make

