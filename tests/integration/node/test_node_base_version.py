"""A run started from a trained checkpoint (`weights.base_version = -1`): no version is the base model, so a node
never generates with the base weights, not even version 0, and it refuses to work for a validator that says
otherwise (it would generate a version with other weights than the validator checks it with)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from test_node_join import node_config

from bench.loopback import RUN, TINY
from contracts.devchain import dev_identity
from contracts.policy import PolicyHistory
from node import commands
from node.engines import build_engine
from node.weights import PolicyWeights, Waiting
from protocol.config import ShardcastWeights
from protocol.errors import ConfigError

pytestmark = pytest.mark.timeout(120)
TRAINER_INDEX = 2  # PUBLIC anvil dev account holding TRAINER_ROLE in the test deployment


def _weights(base_version: int) -> dict[str, Any]:
    # no relay: nothing can be pulled, so whatever the node generates with is the base model
    return {"type": "shardcast", "relays": [], "trainer": dev_identity(TRAINER_INDEX).address,
            "base_version": base_version}


def test_with_no_base_version_the_node_waits_for_the_pulled_weights_instead_of_the_base_model(
        published: Pools, deployment_file: Path, tmp_path: Path) -> None:
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [], run=RUN, model=TINY,
                      weights=_weights(-1))
    node = published.new_node()
    chain = commands.open_chain(cfg)
    history = PolicyHistory(chain.client(node), chain.start_block)

    def policy_weights(base_version: int) -> PolicyWeights:
        return PolicyWeights(ShardcastWeights.model_validate(_weights(base_version)), TINY, RUN, history,
                             lambda spec: build_engine(cfg.engine, spec), tmp_path / f"weights{base_version}")

    # the chain is at v1: with base_version 1 it is the base model's ...
    assert policy_weights(1).select().version == 1
    # ... with -1 it must come over the relays: the node waits (and asks its follower for it), it never uses the base
    none = policy_weights(-1)
    assert none.base is None  # the base weights are not even loaded
    assert none._wanted() == 1
    with pytest.raises(Waiting, match="waiting for the relays"):
        none.select()


def test_a_node_refuses_a_validator_that_checks_with_other_weights(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    served = make_validator(weights=_weights(-1))
    with httpx.Client(timeout=10) as http:
        for base_version in (0, 1):
            cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url],
                              weights=_weights(base_version))
            with pytest.raises(ConfigError, match=r"weights.base_version is \d here and -1 at validator"):
                commands._rules(cfg, None, http)
        agreed = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url], weights=_weights(-1))
        run, model, _ = commands._rules(agreed, None, http)
    assert (run, model) == (RUN, TINY)
