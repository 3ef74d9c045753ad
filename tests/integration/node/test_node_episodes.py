"""prime-node on a multi-turn run: `join` learns the run from its validator, the work loop plays episodes
(`node.episodes`, submission v2) and the served validator accepts them and records the work on chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chainfixtures import OPERATOR, Pools
from test_node_join import PASSWORD, node_config

from bench.loopback import RUN
from contracts.pool import WorkStatus
from node import commands
from node.protection import SlashingProtection
from protocol.canonical import to_hex

pytestmark = pytest.mark.timeout(300)

EPISODES = RUN.model_copy(update={"env": "calc-arith", "env_version": "1", "max_new_tokens": 12})


def test_a_node_plays_episodes_and_its_work_is_accepted_on_chain(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIME_KEYSTORE_PASSWORD", PASSWORD)
    monkeypatch.setenv("TEST_OPERATOR_KEY", published.chain.account(OPERATOR).account.key.hex())
    served = make_validator(run=EPISODES)
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url])
    assert commands.join(cfg) == 0
    node = commands.node_key(cfg)
    key = to_hex(published.work_key(EPISODES.run_id, node.address, 1, 0))
    row = served.wait_reported(key)
    assert row["outcome"] == "accepted", row
    assert published.admin.get_work(key).status is WorkStatus.ACCEPTED
    with SlashingProtection(cfg.state_dir / commands.PROTECTION_DB) as db:
        rec = db.get(EPISODES.run_id, node.address, 1, 0)
        assert rec is not None and rec.state == "decided"
    with served.client() as c:
        sent = c.get(f"/v1/submissions/{key}").json()
    assert sent["outcome"] == "accepted", sent
