"""The announcement wire messages and their topics (schema only: no libp2p, no trio).

Each announcement is a `protocol` envelope (`seal` / `open_envelope`) whose body is one of the
models below, signed by the announcing role's Ethereum key. The envelope's domain names the
network, pool and run (`protocol.rollout.submission_domain`), so an announcement for another run
fails the domain check; the bodies therefore carry no run id of their own.

Every body names the libp2p peer that publishes it (`peer_id`, bound to the gossip message's
origin on receipt) and may list that peer's listen addresses, so a reader can dial it.

These types live in `discovery/`, not in `protocol/`: every role that announces or reads
announcements uses the discovery library anyway, and this module imports nothing heavy
(`discovery/__init__` loads no libp2p), so a role that only reads `GET /v1/announcements` over
HTTP pays for pydantic alone.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, field_validator

from discovery.config import Multiaddr
from protocol.canonical import Hash32
from protocol.envelope import Body

MAX_URLS = 16
MAX_ADDRS = 8
MAX_VERSIONS = 64

PeerIdStr = Annotated[str, Field(pattern=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")]
"""A libp2p peer id in its base58btc text form (`12D3KooW...` for Ed25519 keys)."""
HttpUrl = Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s]*)?$", max_length=512)]
"""An http(s) URL, kept as the exact string signed (no normalisation, so it stays canonical)."""


class Topic(StrEnum):
    """The three announcement topics of a run."""

    POLICY = "policy"
    VALIDATORS = "validators"
    RELAYS = "relays"


def topic_name(domain: str, topic: Topic) -> str:
    """The gossipsub topic string: the envelope domain, the topic, and the schema generation."""
    return f"{domain}/{topic.value}/1"


class _Announced(Body):
    """Fields every announcement has (an intermediate base: no kind, not registered)."""

    peer_id: PeerIdStr
    """The libp2p peer that publishes this announcement (must be the gossip message's origin)."""
    addrs: tuple[Multiaddr, ...] = Field(default=(), max_length=MAX_ADDRS)
    """Addresses that peer listens on (without `/p2p/...`), for readers that want to dial it."""


class PolicyAnnounced(_Announced):
    """The trainer has published policy `policy_version`; its weights are at `urls`."""

    kind = "discovery.policy"
    version = 1

    policy_version: int = Field(ge=0, lt=2**63)
    """The policy version (trainer step)."""
    manifest_hash: Hash32
    """SHA-256 of the signed SHARDCAST manifest (`Manifest.content_hash()`, recorded on chain)."""
    urls: tuple[HttpUrl, ...] = Field(default=(), max_length=MAX_URLS)
    """Origin and relay base URLs known to hold this version."""


class ValidatorAnnounced(_Announced):
    """A validator of the run serves its HTTP API at `http_url`."""

    kind = "discovery.validator"
    version = 1

    http_url: HttpUrl
    """Base URL of the validator's HTTP API (submissions, `/v1/info`, `/v1/announcements`)."""


class RelayAnnounced(_Announced):
    """A SHARDCAST relay serves `versions` at `http_url`."""

    kind = "discovery.relay"
    version = 1

    http_url: HttpUrl
    """Base URL of the relay."""
    versions: tuple[Annotated[int, Field(ge=0, lt=2**63)], ...] = Field(default=(), max_length=MAX_VERSIONS)
    """Policy versions the relay holds completely, ascending, no duplicates."""

    @field_validator("versions")
    @classmethod
    def _ascending(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(b <= a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError("versions must be strictly ascending")
        return value


TOPIC_BODY: dict[Topic, type[_Announced]] = {
    Topic.POLICY: PolicyAnnounced,
    Topic.VALIDATORS: ValidatorAnnounced,
    Topic.RELAYS: RelayAnnounced,
}
"""The one body type each topic carries."""

AnnouncedBody = PolicyAnnounced | ValidatorAnnounced | RelayAnnounced


def topic_of_kind(kind: str) -> Topic | None:
    """The topic whose messages have envelope kind `kind` (None: not an announcement)."""
    for topic, body_type in TOPIC_BODY.items():
        if body_type.kind == kind:
            return topic
    return None


def topic_of(body: AnnouncedBody) -> Topic:
    """The topic a body travels on."""
    for topic, body_type in TOPIC_BODY.items():
        if isinstance(body, body_type):
            return topic
    raise TypeError(f"not an announcement: {type(body).__name__}")
