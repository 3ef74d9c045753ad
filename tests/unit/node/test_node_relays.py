"""Which learned relays a node polls (issue 23 item 12, issue 35 item 8): at most `relays.polled`, one per signer
(the board keeps each signer's newest announcement), ranked by the versions each actually served (verified), then
by its claimed versions cut to the chain's newest, with `relays.random_slots` drawn at random among the rest. Real
signed announcements on a real board; no network."""

from __future__ import annotations

import random

from discovery.admission import Admission, Trust, anyone
from discovery.board import AnnouncementBoard
from discovery.messages import RelayAnnounced, Topic
from node.config import RelaySettings
from node.gossip import polled_relays
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce

DOMAIN = "prime/31337/0x5FbDB2315678afecb367f032d93F642f64180aa3/run-a"
PEER = "12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"
NOW = 1_800_000_000.0


def _offer(board: AnnouncementBoard, who: Identity, url: str, versions: tuple[int, ...], at: float) -> None:
    # a fresh admission per envelope: the per-signer rate limit is not what this test is about
    admission = Admission(domain=DOMAIN, trust=Trust(relay_signer=anyone), clock=lambda: NOW)
    wire = seal(who, RelayAnnounced(peer_id=PEER, http_url=url, versions=versions), domain=DOMAIN,
                nonce=random_nonce(), now=at).to_bytes()
    board.offer(admission.admit(wire, topic=Topic.RELAYS, now=at), now=at)


def test_a_node_polls_a_bounded_set_of_learned_relays_newest_first() -> None:
    board = AnnouncementBoard(clock=lambda: NOW)
    flooder = Identity.create()
    # one signer announcing 50 URLs, one after the other: only its newest counts
    for i in range(50):
        _offer(board, flooder, f"http://10.0.0.1:{9000 + i}", (1,), NOW - 100 + i)
    assert polled_relays(board.relays(), LIMIT, chain_version=3) == ["http://10.0.0.1:9049"]
    # 30 signers: at most `limit` are polled, those holding the newest version first (no random slot here)
    for i in range(30):
        _offer(board, Identity.create(), f"http://10.0.1.{i}:8600", (1, 2) if i % 3 else (1, 2, 3),
               NOW - 40 + i)
    polled = polled_relays(board.relays(), LIMIT, chain_version=3)
    assert len(polled) == LIMIT
    assert set(polled) == {f"http://10.0.1.{i}:8600" for i in range(30) if i % 3 == 0 and i >= 6}


LIMIT = RelaySettings().polled


def test_claimed_versions_cannot_displace_relays_that_served_verified_versions() -> None:
    """Issue 35 item 8: eight staked keys announcing version 2**63-1 displaced every honest learned relay. A claim
    now counts at most as the chain's newest version, and a relay that actually served a verified version ranks
    above every mere claim."""
    board = AnnouncementBoard(clock=lambda: NOW)
    honest = [f"http://10.0.2.{i}:8600" for i in range(LIMIT)]
    liars = [f"http://10.6.6.{i}:8600" for i in range(LIMIT)]
    for i, url in enumerate(honest):
        _offer(board, Identity.create(), url, (1, 2, 3), NOW - 60 + i)
    for i, url in enumerate(liars):  # announced later (newer signatures), claiming versions nobody published
        _offer(board, Identity.create(), url, (2**63 - 1,), NOW - 10 + i)
    # nothing served yet: every claim is cut to the chain's v3, so the liars rank like the honest relays, no higher
    # (the newest signatures break the tie), and none of them outranks a relay by its claim alone
    unproven = polled_relays(board.relays(), LIMIT, chain_version=3)
    assert set(unproven) == set(liars)  # a tie at v3 broken by recency: what random slots are for (below)
    # once honest relays served v3 (fetched, hash-checked, on chain), they are polled whatever the liars claim
    served = {url: 3 for url in honest}
    assert polled_relays(board.relays(), LIMIT, verified=served, chain_version=3) == sorted(honest)
    # with nothing on chain, no claim counts at all
    assert polled_relays(board.relays(), LIMIT, chain_version=None, verified=served) == sorted(honest)


def test_random_slots_give_unranked_relays_a_turn() -> None:
    """`random_slots` of the polled slots are drawn among the admitted relays outside the ranked ones: a new
    honest relay that nobody has verified yet is tried, however many keys outrank it by claims."""
    board = AnnouncementBoard(clock=lambda: NOW)
    urls = [f"http://10.0.3.{i}:8600" for i in range(20)]
    for i, url in enumerate(urls):
        _offer(board, Identity.create(), url, (3,), NOW - 60 + i)
    slots = RelaySettings().random_slots
    assert slots >= 1
    ranked = set(polled_relays(board.relays(), LIMIT - slots, chain_version=3))
    seen: set[str] = set()
    for seed in range(40):
        polled = polled_relays(board.relays(), LIMIT, chain_version=3, random_slots=slots, rng=random.Random(seed))
        assert len(polled) == LIMIT and ranked <= set(polled)
        seen |= set(polled) - ranked
    assert seen == set(urls) - ranked  # over a few draws every unranked relay got a slot
    # the same draw is the same set (a follower is not rebuilt for nothing)
    again = [polled_relays(board.relays(), LIMIT, chain_version=3, random_slots=slots, rng=random.Random(7))
             for _ in range(2)]
    assert again[0] == again[1]
