"""The announcement board: newest per (topic, signer), TTL, bounded size, subscriptions from threads
and asyncio, and the JSON it serves."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from discovery_testkit import NOW, Keys, make_admission, policy, relay, sign, validator_body

from discovery.admission import Admission, Announcement, Trust, allow
from discovery.board import AnnouncementBoard, Outcome, admit_to_board
from discovery.errors import DiscoveryError, StaleError
from discovery.http import split_announcements
from discovery.messages import Topic
from protocol.errors import ReplayError
from protocol.identity import Identity


def _ann(adm: Admission, wire: bytes, topic: Topic) -> Announcement:
    return adm.admit(wire, topic=topic)


def board() -> AnnouncementBoard:
    return AnnouncementBoard(clock=lambda: NOW)


def test_outcomes(admission: Admission, keys: Keys) -> None:
    b = board()
    first = _ann(admission, sign(keys.validator, validator_body("http://a:1")), Topic.VALIDATORS)
    assert b.offer(first) is Outcome.NEW
    assert b.offer(first) is Outcome.DUPLICATE
    same = _ann(admission, sign(keys.validator, validator_body("http://a:1"), now=NOW + 1), Topic.VALIDATORS)
    assert b.offer(same) is Outcome.REFRESHED
    moved = _ann(admission, sign(keys.validator, validator_body("http://b:2"), now=NOW + 2), Topic.VALIDATORS)
    assert b.offer(moved) is Outcome.CHANGED
    older = _ann(admission, sign(keys.validator, validator_body("http://c:3"), now=NOW - 1), Topic.VALIDATORS)
    assert b.offer(older) is Outcome.STALE
    [held] = b.validators()
    assert held.wire == moved.wire


def test_policy_orders_by_version_before_time(admission: Admission, keys: Keys) -> None:
    b = board()
    v5 = _ann(admission, sign(keys.trainer, policy(5)), Topic.POLICY)
    v4_later = _ann(admission, sign(keys.trainer, policy(4), now=NOW + 5), Topic.POLICY)
    assert b.offer(v5) is Outcome.NEW
    assert b.offer(v4_later) is Outcome.STALE  # a rollback is not believed
    current = b.current_policy()
    assert current is not None and current.body.policy_version == 5  # type: ignore[union-attr]


def test_ttl(admission: Admission, keys: Keys) -> None:
    clock = [NOW]
    b = AnnouncementBoard(clock=lambda: clock[0])
    ann = _ann(admission, sign(keys.stranger, relay((1, 2))), Topic.RELAYS)
    assert b.offer(ann) is Outcome.NEW
    assert [a.signer for a in b.relays(2)] == [keys.stranger.address] and b.relays(3) == []
    clock[0] = ann.expires_at
    assert b.relays() == [] and b.to_json() == b"[]"
    assert b.sweep() == 1
    # An announcement already past its TTL is not taken.
    assert b.offer(ann) is Outcome.STALE


def test_bounded_per_topic_forgets_the_oldest(trust: Trust) -> None:
    signers = [Identity.create() for _ in range(3)]
    adm = make_admission(trust)
    b = AnnouncementBoard(max_per_topic=2, clock=lambda: NOW)
    for i, ident in enumerate(signers):
        b.offer(_ann(adm, sign(ident, relay(), now=NOW - 10 + i), Topic.RELAYS))
    assert {a.signer for a in b.relays()} == {signers[1].address, signers[2].address}


def test_json_is_the_signed_envelopes(admission: Admission, keys: Keys) -> None:
    b = board()
    wires = [sign(keys.trainer, policy(2)), sign(keys.validator, validator_body())]
    b.offer(_ann(admission, wires[0], Topic.POLICY))
    b.offer(_ann(admission, wires[1], Topic.VALIDATORS))
    assert sorted(split_announcements(b.to_json())) == sorted(wires)


def test_admit_to_board_tells_duplicates_from_replays(keys: Keys) -> None:
    adm = make_admission(Trust(trainer=keys.trainer.address, is_validator=allow([keys.validator.address])))
    b = board()
    wire = sign(keys.validator, validator_body())
    assert admit_to_board(adm, b, wire, topic=Topic.VALIDATORS, source="http") is Outcome.NEW
    # Reading the same list again: what we hold is not news.
    assert admit_to_board(adm, b, wire, topic=Topic.VALIDATORS, source="http") is Outcome.DUPLICATE
    # The first gossip copy of what we learnt over HTTP is forwarded once; the next is a replay.
    assert admit_to_board(adm, b, wire, topic=Topic.VALIDATORS, source="gossip") is Outcome.DUPLICATE
    with pytest.raises(ReplayError):
        admit_to_board(adm, b, wire, topic=Topic.VALIDATORS, source="gossip")
    newer = sign(keys.validator, validator_body(), now=NOW + 1)
    assert admit_to_board(adm, b, newer, topic=Topic.VALIDATORS, source="gossip") is Outcome.REFRESHED
    with pytest.raises(ReplayError):
        admit_to_board(adm, b, newer, topic=Topic.VALIDATORS, source="gossip")
    # A replay of what is no longer held, over either path.
    with pytest.raises(ReplayError):
        admit_to_board(adm, b, wire, topic=Topic.VALIDATORS, source="http")
    older = sign(keys.validator, validator_body(), now=NOW - 1)
    with pytest.raises(StaleError):
        admit_to_board(adm, b, older, topic=Topic.VALIDATORS, source="gossip")


def test_subscription_from_a_thread(admission: Admission, keys: Keys) -> None:
    b = board()
    b.offer(_ann(admission, sign(keys.trainer, policy(1)), Topic.POLICY))
    sub = b.subscribe([Topic.POLICY])
    replayed = sub.get(timeout=5)
    assert replayed is not None and replayed.body.policy_version == 1  # type: ignore[union-attr]
    assert sub.get(timeout=0.01) is None
    got: list[Announcement] = []
    reader = threading.Thread(target=lambda: got.extend(sub))
    reader.start()
    b.offer(_ann(admission, sign(keys.stranger, relay()), Topic.RELAYS))  # other topic: not delivered
    v2 = _ann(admission, sign(keys.trainer, policy(2)), Topic.POLICY)
    b.offer(v2)
    b.offer(_ann(admission, sign(keys.trainer, policy(2), now=NOW + 1), Topic.POLICY))  # refresh: no event
    sub.close()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert [a.wire for a in got] == [v2.wire]
    with pytest.raises(DiscoveryError):
        sub.get(timeout=1)


def test_slow_subscriber_loses_the_oldest(admission: Admission, trust: Trust) -> None:
    b = board()
    sub = b.subscribe(maxsize=2, replay=False)
    for ident in [Identity.create() for _ in range(4)]:
        b.offer(_ann(admission, sign(ident, relay()), Topic.RELAYS))
    assert sub.dropped == 2
    assert len(b.relays()) == 4  # the board keeps the state
    b.close()
    assert len(list(sub)) == 2


def test_subscription_from_asyncio(admission: Admission, keys: Keys) -> None:
    b = board()

    async def main() -> list[int]:
        sub = b.subscribe([Topic.POLICY], replay=False)
        seen: list[int] = []

        async def read() -> None:
            async for ann in sub:
                seen.append(ann.body.policy_version)  # type: ignore[union-attr]

        task = asyncio.create_task(read())
        for v in (1, 2, 3):
            # Offered from another thread, as the libp2p host's validator does.
            await asyncio.to_thread(b.offer, _ann(admission, sign(keys.trainer, policy(v)), Topic.POLICY))
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        sub.close()
        await asyncio.wait_for(task, timeout=10)
        return seen

    assert asyncio.run(asyncio.wait_for(main(), timeout=20)) == [1, 2, 3]


def test_served_announcements_stay_within_what_readers_accept(admission: Admission, keys: Keys) -> None:
    """Issue 23 item 12: however many relay announcements the board holds, `/v1/announcements` stays under the
    readers' item and byte limits, and the policy and validator announcements are never pushed out by relays."""
    from discovery.board import SERVE_MAX_BYTES, SERVE_MAX_ITEMS
    from discovery.http import MAX_ITEMS, MAX_RESPONSE_BYTES

    assert SERVE_MAX_ITEMS <= MAX_ITEMS and SERVE_MAX_BYTES <= MAX_RESPONSE_BYTES
    b = board()
    b.offer(_ann(admission, sign(keys.trainer, policy(9)), Topic.POLICY))
    b.offer(_ann(admission, sign(keys.validator, validator_body()), Topic.VALIDATORS))
    big = tuple(range(64))  # the largest relay body the schema allows
    for i in range(60):
        b.offer(_ann(admission, sign(Identity.create(), relay(big, url=f"http://127.0.0.1:{9000 + i}"),
                                     now=NOW - 60 + i), Topic.RELAYS))
    everything = split_announcements(b.to_json(max_items=10_000, max_bytes=1 << 30))
    assert len(everything) == 62
    for items, size in [(10, 1 << 30), (10_000, 20_000), (3, 1 << 30)]:
        served = b.to_json(max_items=items, max_bytes=size)
        kept = split_announcements(served)
        assert len(served) <= size and len(kept) <= items
        kinds = [json.loads(w)["kind"] for w in kept]
        assert kinds[:2] == ["discovery.policy", "discovery.validator"]
        # the relays kept are the newest signed
        sent = [json.loads(w)["timestamp_ms"] for w in kept[2:]]
        assert sent == sorted(sent, reverse=True) and (not sent or max(sent) == int((NOW - 1) * 1000))
    assert len(split_announcements(b.to_json())) == 62  # the defaults hold this board whole
