"""Admission: the one check every announcement passes, whether it came over gossip or HTTP.

`Admission.admit(data, topic=...)` returns a verified `Announcement` or raises the reason as a
typed error (all `ProtocolError` subclasses). Checks, cheapest first:

1. the forwarding peer's rate (`RateLimitedError`), before anything is parsed;
2. size (`OversizeError`), canonical envelope form (`ProtocolError`);
3. the body names the publishing libp2p peer (`PeerMismatchError`), checked before the signature so
   a peer re-publishing someone else's fresh envelope cannot spend its nonce and so suppress it;
4. the publishing peer's rate (`RateLimitedError`);
5. the envelope (`protocol.envelope.open_envelope`): domain = network, pool and run
   (`DomainError`), kind fits the topic (`UnknownVersionError`), age within the TTL and clock skew
   (`ExpiredError`), signature (`SignatureError`), canonical body;
6. the signer may speak on this topic (`NotBelievedError`): the run's trainer for policy versions,
   a validator (the role's callable, e.g. VALIDATOR_ROLE on chain) for validators; for relays the
   trainer (its origin), a validator, or whoever `Trust.relay_signer` admits (a node reader: an active,
   staked node of the pool; a relay without a chain: the addresses its operator lists). Checked before
   the nonce is recorded, so strangers cannot fill the replay guard, nor a relay's learned upstreams,
   nor the list of relays a node polls: every believed relay signer has a role or stake at risk, and the
   board keeps one (the newest) announcement per signer;
7. the nonce is new (`ReplayError`), then the signer's own rate (`RateLimitedError`);
8. for policy versions, the role's chain hook, when given (`NotBelievedError`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from discovery.config import DiscoveryConfig
from discovery.errors import NotBelievedError, PeerMismatchError, RateLimitedError
from discovery.messages import TOPIC_BODY, AnnouncedBody, PolicyAnnounced, Topic
from discovery.ratelimit import Buckets
from protocol.envelope import Envelope, NonceGuard, open_envelope
from protocol.errors import OversizeError
from protocol.identity import checksum
from protocol.replay import ReplayGuard

log = logging.getLogger(__name__)


def nobody(address: str) -> bool:
    """The default validator check: believe no one until the role says who holds the role."""
    del address
    return False


def anyone(address: str) -> bool:
    """A relay-signer check that believes every signer: for tests and benchmarks of the gossip transport
    only (a role that follows relays must ask for a role or stake: issue 23 item 12)."""
    del address
    return True


def allow(addresses: Iterable[str]) -> Callable[[str], bool]:
    """A validator check from a fixed set of addresses (a run without a chain, tests)."""
    allowed = frozenset(checksum(a) for a in addresses)
    return allowed.__contains__


@dataclass(frozen=True)
class Trust:
    """Who is believed on each topic; the role supplies it (discovery imports no chain client)."""

    trainer: str | None = None
    """The run's trainer address: the only signer believed on the policy topic (None: nobody)."""
    is_validator: Callable[[str], bool] = nobody
    """Whether a (checksummed) address holds the validator role; called per new announcement, so
    make it a cached lookup (the validator's chain view), not an RPC round trip."""
    relay_signer: Callable[[str], bool] = nobody
    """Who else (besides the trainer and validators) may announce relays: e.g. an active, staked node of the
    pool (`PoolClient.is_active`: stake at risk); cached like `is_validator`."""
    policy_check: Callable[[PolicyAnnounced], bool] | None = None
    """When a chain is configured: whether `PolicyPublished(version, manifest_hash)` is on chain.
    False rejects the announcement (it is not forwarded)."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what is admitted (policy in config: see `discovery.config.DiscoveryConfig`)."""

    max_bytes: int = 8192
    """Larger announcements are refused unparsed."""
    ttl_s: float = 120.0
    """An announcement is believed this long after it was signed (older ones are refused)."""
    max_skew_s: float = 30.0
    """Announcements dated further than this in the future are refused."""
    forwarder_rate: float = 100.0
    """Messages per second one libp2p peer may forward to us (all origins together)."""
    forwarder_burst: float = 500.0
    """Bucket size of the forwarder limit."""
    origin_rate: float = 5.0
    """Messages per second one libp2p peer may publish (as origin)."""
    origin_burst: float = 30.0
    """Bucket size of the origin limit."""
    signer_rate: float = 1.0
    """Announcements per second one Ethereum signer may make."""
    signer_burst: float = 10.0
    """Bucket size of the signer limit."""

    @classmethod
    def from_config(cls, config: DiscoveryConfig) -> Limits:
        """The limits a role's `discovery` config section sets."""
        return cls(
            max_bytes=config.max_message_bytes,
            ttl_s=config.ttl_s,
            max_skew_s=config.max_skew_s,
            forwarder_rate=config.forwarder_rate,
            forwarder_burst=config.forwarder_burst,
            origin_rate=config.origin_rate,
            origin_burst=config.origin_burst,
            signer_rate=config.signer_rate,
            signer_burst=config.signer_burst,
        )


@dataclass(frozen=True)
class Announcement:
    """An announcement that passed admission."""

    topic: Topic
    envelope: Envelope
    body: AnnouncedBody
    wire: bytes = field(repr=False)
    """The envelope's canonical bytes (what is served over HTTP and re-published)."""
    received_at: float
    expires_at: float
    """Believed until then (signing time + TTL)."""
    source: str
    """`self`, `gossip` or `http`."""

    @property
    def signer(self) -> str:
        return self.envelope.signer

    @property
    def sent_at(self) -> float:
        return self.envelope.timestamp_ms / 1000


class _Gate:
    """The replay guard as `open_envelope` sees it: the topic's authorization first (the signer is
    verified by then), then the nonce, then the signer's rate."""

    def __init__(self, admission: Admission, topic: Topic) -> None:
        self.admission = admission
        self.topic = topic

    def check_and_record(
        self,
        domain: str,
        signer: str,
        nonce: int,
        *,
        sent_at: float,
        expires_at: float,
        now: float | None = None,
    ) -> None:
        self.admission.authorize(self.topic, signer)
        self.admission.replay_guard.check_and_record(
            domain, signer, nonce, sent_at=sent_at, expires_at=expires_at, now=now
        )
        if not self.admission.signers.take(signer):
            raise RateLimitedError(f"{signer} announces faster than {self.admission.limits.signer_rate}/s")


class Admission:
    """Verifies announcements for one run; thread-safe (the replay guard and buckets lock)."""

    def __init__(
        self,
        *,
        domain: str,
        trust: Trust,
        limits: Limits | None = None,
        replay_guard: NonceGuard | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.domain = domain
        self.trust = trust
        self.limits = limits or Limits()
        self.replay_guard: NonceGuard = replay_guard if replay_guard is not None else ReplayGuard(":memory:")
        self.clock = clock
        self._trainer = checksum(trust.trainer) if trust.trainer is not None else None
        lim = self.limits
        self.forwarders = Buckets(lim.forwarder_rate, lim.forwarder_burst)
        self.origins = Buckets(lim.origin_rate, lim.origin_burst)
        self.signers = Buckets(lim.signer_rate, lim.signer_burst)

    def authorize(self, topic: Topic, signer: str) -> None:
        """`NotBelievedError` unless `signer` may announce on `topic`."""
        if topic is Topic.POLICY:
            if self._trainer is None or signer != self._trainer:
                raise NotBelievedError(f"{signer} is not the run's trainer")
        elif topic is Topic.VALIDATORS:
            if not self.trust.is_validator(signer):
                raise NotBelievedError(f"{signer} does not hold the validator role")
        elif topic is Topic.RELAYS:
            if (
                signer != self._trainer
                and not self.trust.is_validator(signer)
                and not self.trust.relay_signer(signer)
            ):
                raise NotBelievedError(
                    f"{signer} is neither the trainer, a validator nor a staked relay signer"
                )

    def admit(
        self,
        data: bytes,
        *,
        topic: Topic,
        origin_peer: str | None = None,
        forwarder: str | None = None,
        source: str = "gossip",
        now: float | None = None,
    ) -> Announcement:
        """Verify `data` as an announcement on `topic` (module docstring: the checks in order).

        `origin_peer` is the libp2p peer that published the gossip message (None for HTTP, where
        no libp2p signature travels); `forwarder` the peer that handed it to us.
        """
        if forwarder is not None and not self.forwarders.take(forwarder):
            raise RateLimitedError(f"peer {forwarder} forwards faster than {self.limits.forwarder_rate}/s")
        if len(data) > self.limits.max_bytes:
            raise OversizeError(f"announcement is {len(data)} bytes, limit {self.limits.max_bytes}")
        envelope = Envelope.from_bytes(data, max_bytes=self.limits.max_bytes)
        if origin_peer is not None:
            named = envelope.body.get("peer_id")
            if named != origin_peer:
                raise PeerMismatchError(f"announcement names peer {named!r}, published by {origin_peer}")
            if not self.origins.take(origin_peer):
                raise RateLimitedError(
                    f"peer {origin_peer} publishes faster than {self.limits.origin_rate}/s"
                )
        now_s = self.clock() if now is None else now
        opened = open_envelope(
            envelope,
            domain=self.domain,
            replay_guard=_Gate(self, topic),
            body_types=[TOPIC_BODY[topic]],
            max_age_s=self.limits.ttl_s,
            max_skew_s=self.limits.max_skew_s,
            now=now_s,
        )
        body = cast(AnnouncedBody, opened)  # `body_types` admits only the topic's body type
        if isinstance(body, PolicyAnnounced) and self.trust.policy_check is not None:
            if not self.trust.policy_check(body):
                raise NotBelievedError(
                    f"policy {body.policy_version} with manifest 0x{body.manifest_hash.hex()} is not on chain"
                )
        return Announcement(
            topic=topic,
            envelope=envelope,
            body=body,
            wire=data,
            received_at=now_s,
            expires_at=envelope.timestamp_ms / 1000 + self.limits.ttl_s,
            source=source,
        )
