"""Announcement bodies: bounded, canonical, one topic each."""

from __future__ import annotations

import pytest
from discovery_testkit import PEER, policy, relay
from pydantic import ValidationError

from discovery.messages import (
    TOPIC_BODY,
    PolicyAnnounced,
    RelayAnnounced,
    Topic,
    ValidatorAnnounced,
    topic_name,
    topic_of,
    topic_of_kind,
)


def test_topics() -> None:
    assert topic_name("prime/1/0xP/run", Topic.POLICY) == "prime/1/0xP/run/policy/1"
    for topic, body_type in TOPIC_BODY.items():
        assert topic_of_kind(body_type.kind) is topic
    assert topic_of_kind("submission") is None
    assert topic_of(policy()) is Topic.POLICY and topic_of(relay()) is Topic.RELAYS


@pytest.mark.parametrize(
    "build",
    [
        lambda: PolicyAnnounced(peer_id=PEER, policy_version=1, manifest_hash=b"\x11" * 31),
        lambda: PolicyAnnounced(peer_id=PEER, policy_version=-1, manifest_hash=b"\x11" * 32),
        lambda: PolicyAnnounced(peer_id="not a peer id!", policy_version=1, manifest_hash=b"\x11" * 32),
        lambda: PolicyAnnounced(peer_id=PEER, policy_version=1, manifest_hash=b"\x11" * 32, urls=("ftp://x",)),
        lambda: PolicyAnnounced(peer_id=PEER, policy_version=1, manifest_hash=b"\x11" * 32,
                                urls=("http://a",) * 17),
        lambda: ValidatorAnnounced(peer_id=PEER, http_url="http://a b"),
        lambda: ValidatorAnnounced(peer_id=PEER, http_url="http://a", addrs=("not-a-multiaddr",)),
        lambda: RelayAnnounced(peer_id=PEER, http_url="http://a", versions=(2, 1)),
        lambda: RelayAnnounced(peer_id=PEER, http_url="http://a", versions=(1, 1)),
        lambda: RelayAnnounced(peer_id=PEER, http_url="http://a", versions=tuple(range(65))),
        lambda: RelayAnnounced(peer_id=PEER, http_url="http://a", extra=1),  # type: ignore[call-arg]
    ],
)
def test_bad_bodies_are_refused(build: object) -> None:
    with pytest.raises(ValidationError):
        build()  # type: ignore[operator]


def test_good_bodies() -> None:
    body = ValidatorAnnounced(peer_id=PEER, http_url="https://v.example:8700/api", addrs=("/ip4/10.0.0.5/tcp/4001",))
    assert body.model_dump(mode="json")["addrs"] == ["/ip4/10.0.0.5/tcp/4001"]
    assert policy().model_dump(mode="json")["manifest_hash"] == "0x" + "11" * 32
