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

    def make(register: bool = True) -> SimNode:
        node = published.new_node() if register else Identity.create()
        return SimNode(node, tiny_model, domain)

    return make
