"""Fixtures of the validator tests (the chain, model and validator fixtures are in tests/integration/conftest.py)."""

from __future__ import annotations

import pytest
from chainfixtures import Pools

from bench.adversaries import SimNode
from bench.loopback import RUN
from models.loading import LoadedModel
from protocol.identity import Identity
from protocol.rollout import submission_domain


@pytest.fixture
def make_node(published: Pools, tiny_model: LoadedModel):  # type: ignore[no-untyped-def]
    domain = submission_domain(published.deployment.chain_id, published.deployment.pool, RUN.run_id)

    def make(register: bool = True, identity: Identity | None = None) -> SimNode:
        """A node with a fresh random key, or `identity` (a test whose premise depends on the key picks
        one that meets it); registered with the pool's minimum stake unless `register=False`."""
        if identity is None:
            node = published.new_node() if register else Identity.create()
        else:
            node = identity
            if register:
                published.operator.register(node, published.admin.params().min_stake)
        return SimNode(node, tiny_model, domain)

    return make
