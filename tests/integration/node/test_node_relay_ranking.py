"""Learned relays rank by what they served, not by what they claim (issue 35 item 8): eight staked keys announcing
version 2**63-1 displaced every honest learned relay. Here a real SHARDCAST origin serves v2, the trainer publishes
v2's manifest hash on anvil, the node's pull installs it, and the relay announcements pass the node's own admission
(signed, staked on chain). The relay that actually served v2 is polled whatever the others claim; a version that is
installed but not the chain's earns nothing."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from chainfixtures import TRAINER, Pools
from test_node_join import node_config

from bench.loopback import RUN, TINY, make_checkpoint
from contracts.policy import PolicyHistory
from discovery.messages import RelayAnnounced, Topic
from node import commands
from node.gossip import NodeGossip
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.rollout import submission_domain
from shardcast.client import Client, PullResult
from shardcast.origin import Origin

PEER = "12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"


def _pull(tmp_path: Path, trainer: Identity, version: int) -> tuple[PullResult, str]:
    """Publish a small checkpoint as `version` at a real origin on loopback and pull it: (the pull, origin URL)."""
    ckpt = make_checkpoint(tmp_path / f"ckpt{version}", {"w.bin": 48 << 10}, seed=version)

    async def body() -> tuple[PullResult, str]:
        async with Origin(tmp_path / f"origin{version}", run_id=RUN.run_id, identity=trainer,
                          shard_size=16 << 10) as origin:
            await origin.wait_published(origin.publish(ckpt, version=version))
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / f"out{version}",
                            progress=False)
            return await client.pull(), origin.url

    return asyncio.run(body())


def test_relays_that_served_verified_versions_outrank_any_claim(published: Pools, deployment_file: Path,
                                                                tmp_path: Path) -> None:
    trainer = published.chain.account(TRAINER)
    served, origin_url = _pull(tmp_path, trainer, 2)
    assert served.served == {origin_url: len(served.manifest.shards)}  # every shard came from it, hash-checked
    published.trainer.publish_policy(2, served.manifest.content_hash())
    unpublished, other_url = _pull(tmp_path, trainer, 3)  # signed by the trainer, but v3 is not on chain

    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [], run=RUN, model=TINY,
                      discovery={"enabled": True, "listen": ["/ip4/127.0.0.1/tcp/0"], "target_peers": 0},
                      relays={"polled": 8, "random_slots": 2})
    chain = commands.open_chain(cfg)
    pool = chain.client(node)
    history = PolicyHistory(pool, chain.start_block)
    history.refresh()
    assert history.current() == 2
    domain = submission_domain(chain.chain_id, chain.pool, RUN.run_id)
    gossip = NodeGossip(cfg, pool=pool, history=history, domain=domain, trainer=trainer.address)  # not started

    def announce(url: str, versions: tuple[int, ...]) -> None:
        wire = seal(published.new_node(), RelayAnnounced(peer_id=PEER, http_url=url, versions=versions),
                    domain=domain, nonce=random_nonce()).to_bytes()
        gossip.discovery.board.offer(gossip.discovery.admission.admit(wire, topic=Topic.RELAYS))

    announce(origin_url, (2,))
    announce(other_url, (2, 3))
    liars = [f"http://10.6.6.{i}:8600" for i in range(8)]
    for url in liars:  # staked keys, signed after the honest relay, claiming a version nobody published
        announce(url, (2**63 - 1,))
    assert len(gossip.discovery.board.relays()) == 10

    gossip.note_install(unpublished)  # installed, but not the chain's v3: earns nothing
    gossip.note_install(served)
    assert gossip.verified == {origin_url: 2}
    polled = gossip.relay_urls()
    assert len(polled) == 8 and origin_url in polled
    # whatever the draw: the relay that served v2 holds a ranked slot, and the liars' claims count as v2 at most
    for seed in range(20):
        draw = _draw(gossip, seed)
        assert origin_url in draw and len(draw) == 8


def _draw(gossip: NodeGossip, seed: int) -> list[str]:
    """The polled set for a given random draw (the same ranking `relay_urls` uses)."""
    from node.gossip import polled_relays

    s = gossip.relay_settings
    return polled_relays(gossip.discovery.board.relays(), s.polled, verified=gossip.verified,
                         chain_version=gossip.history.current(), random_slots=s.random_slots,
                         rng=random.Random(seed))
