"""A node configured with no validator URL learns the run's validator from its libp2p announcement (believed
because the announcing address holds VALIDATOR_ROLE on chain), submits there and is accepted; its bootstrap
peers come from its config, or (none configured) from the pool's on-chain record, whose junk entries it skips."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from netfixtures import free_port
from test_node_join import node_config

from bench.loopback import RUN, TINY
from node import commands
from protocol.canonical import to_hex

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
    row = served.wait_decided(to_hex(published.work_key(RUN.run_id, node.address, 1, 0)), timeout=180)
    assert row["outcome"] == "accepted", row
    thread.join(timeout=120)
    assert not thread.is_alive() and not failure, failure


def test_a_node_learns_the_run_s_relays_over_gossip(published: Pools, deployment_file: Path, tmp_path: Path) -> None:
    """Relays are found the same way: a relay's signed announcement reaches a node that has only a bootstrap peer.
    Only a signer with stake (an active node of the pool; or the trainer, a validator) is believed (issue 23 item
    12): a relay announced by a key made for free is dropped. What a relay serves is verified anyway."""
    from contracts.policy import PolicyHistory
    from discovery.admission import Trust, anyone
    from discovery.config import DiscoveryConfig
    from discovery.messages import Topic
    from discovery.service import Discovery
    from node.gossip import NodeGossip
    from protocol.identity import Identity
    from protocol.rollout import submission_domain

    domain = submission_domain(published.deployment.chain_id, published.deployment.pool, RUN.run_id)
    def host(name: str, identity: Identity) -> Discovery:
        return Discovery(DiscoveryConfig(enabled=True, listen=["/ip4/127.0.0.1/tcp/0"], target_peers=0,
                                         reannounce_s=1.0),
                         identity=identity, domain=domain, trust=Trust(trainer=None, relay_signer=anyone),
                         state_dir=tmp_path / name, topics=[Topic.POLICY, Topic.RELAYS])

    relay, stranger = host("relay", published.new_node()), host("stranger", Identity.create())
    relay.start()
    stranger.start()
    gossip = None
    try:
        stranger.announce_relay("http://127.0.0.1:8602", versions=[1, 2])
        relay.announce_relay("http://127.0.0.1:8601", versions=[1])
        node = published.new_node()
        cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [], run=RUN, model=TINY,
                          discovery={"enabled": True, "bootstrap": [*relay.addrs, *stranger.addrs], "reannounce_s": 1.0,
                                     "target_peers": 0})
        chain = commands.open_chain(cfg)
        pool = chain.client(node)
        gossip = NodeGossip(cfg, pool=pool, history=PolicyHistory(pool, chain.start_block), domain=domain, trainer=None)
        gossip.start()
        deadline = time.monotonic() + 30
        while gossip.relay_urls() != ["http://127.0.0.1:8601"] or not gossip.discovery.stats().get(
                "dropped.not_believed"):
            assert time.monotonic() < deadline, (gossip.relay_urls(), gossip.discovery.stats())
            time.sleep(0.1)
        assert gossip.relay_urls() == ["http://127.0.0.1:8601"]  # the stranger's was seen and dropped
    finally:
        if gossip is not None:
            gossip.stop()
        relay.stop()
        stranger.stop()
