"""A node configured with no validator URL learns the run's validator from its libp2p announcement (believed
because the announcing address holds VALIDATOR_ROLE on chain), submits there and is accepted; its bootstrap
peers come from its config, or (none configured) from the pool's on-chain record, whose junk entries it skips."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from netfixtures import free_port
from test_node_join import node_config
from validator_harness import RUN, TINY

from node import commands
from protocol.canonical import to_hex
from protocol.seeds import work_key

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("bootstrap_from", ["config", "chain"])
def test_a_node_finds_its_validator_over_gossip(published: Pools, deployment_file: Path, make_validator: Any,
                                                 tmp_path: Path, bootstrap_from: str) -> None:
    port = free_port()
    served = make_validator(port=port, public_url=f"http://127.0.0.1:{port}",
                            discovery={"enabled": True, "reannounce_s": 1.0})
    bootstrap = httpx.get(f"{served.url}/v1/info", timeout=10).json()["discovery"]["addrs"]
    node = published.new_node()
    discovery: dict[str, Any] = {"enabled": True, "reannounce_s": 1.0, "target_peers": 0}
    if bootstrap_from == "config":
        discovery["bootstrap"] = bootstrap
    else:  # the pool admin records the run's bootstrap peers (untrusted entries: junk among them is skipped)
        published.admin.set_bootstrap_peers(["not a multiaddr", "/ip4/127.0.0.1/tcp/1", *bootstrap])
        assert published.admin.bootstrap_peers()[2:] == bootstrap
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [], run=RUN, model=TINY, max_batches=1,
                      discovery=discovery)
    chain = commands.open_chain(cfg)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            commands.work(cfg, node, chain)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    row = served.wait_decided(to_hex(work_key(RUN.run_id, node.address, 1, 0)), timeout=180)
    assert row["outcome"] == "accepted", row
    thread.join(timeout=120)
    assert not thread.is_alive() and not failure, failure
