"""Which learned relays a node polls (issue 23 item 12): at most `MAX_POLLED_RELAYS`, one per signer (the board
keeps each signer's newest announcement), those holding the newest versions first. Real signed announcements
on a real board; no network."""

from __future__ import annotations

from discovery.admission import Admission, Trust, anyone
from discovery.board import AnnouncementBoard
from discovery.messages import RelayAnnounced, Topic
from node.gossip import MAX_POLLED_RELAYS, polled_relays
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
    assert polled_relays(board.relays()) == ["http://10.0.0.1:9049"]
    # 30 signers: at most MAX_POLLED_RELAYS are polled, those holding the newest version first
    for i in range(30):
        _offer(board, Identity.create(), f"http://10.0.1.{i}:8600", (1, 2) if i % 3 else (1, 2, 3),
               NOW - 40 + i)
    polled = polled_relays(board.relays())
    assert len(polled) == MAX_POLLED_RELAYS
    assert set(polled) == {f"http://10.0.1.{i}:8600" for i in range(30) if i % 3 == 0 and i >= 6}
