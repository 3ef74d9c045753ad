"""The `discovery` section of a role's config (schema only: imports no libp2p)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

Multiaddr = Annotated[str, Field(pattern=r"^(/[A-Za-z0-9._:\-]+)+$", max_length=256)]
"""A libp2p multiaddr as text (`/ip4/10.0.0.5/tcp/4001`); parsed only when dialled. Defined here, not
in `discovery.messages`, so role configs (and their `--help`) do not import eth-account."""


class DiscoveryConfig(BaseModel):
    """libp2p gossipsub discovery: where to listen, whom to bootstrap from, how often to re-announce."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Run libp2p discovery (also switched on by giving `bootstrap` peers)."""
    listen: list[Multiaddr] = ["/ip4/127.0.0.1/tcp/0"]
    """Addresses the libp2p host listens on (`/ip4/0.0.0.0/tcp/4001` to accept peers from elsewhere)."""
    announce_addrs: list[Multiaddr] = []
    """Addresses other peers should dial (e.g. a public address in front of NAT); default: the
    addresses actually bound."""
    bootstrap: list[Multiaddr] = []
    """Peers to join through, as full multiaddrs with `/p2p/<peer id>`; re-dialled while disconnected."""
    key_file: Path | None = None
    """The libp2p identity (Ed25519, separate from the Ethereum key); default `<state_dir>/libp2p.key`,
    created on first start with mode 0600."""
    reannounce_s: float = Field(30.0, gt=0.0)
    """Our own announcements are re-signed and re-published this often, so late joiners learn them."""
    ttl_s: float = Field(120.0, gt=0.0)
    """An announcement is believed this long after it was signed (keep it a few `reannounce_s`)."""
    max_skew_s: float = Field(30.0, ge=0.0)
    """Announcements dated further than this in the future are refused."""
    max_message_bytes: int = Field(8192, ge=512, le=1 << 20)
    """Larger announcements are dropped unparsed."""
    forwarder_rate: float = Field(100.0, gt=0.0)
    """Messages per second one peer may forward to us, all origins together (excess is dropped)."""
    forwarder_burst: float = Field(500.0, ge=1.0)
    """Bucket size of the forwarder limit."""
    origin_rate: float = Field(5.0, gt=0.0)
    """Messages per second one libp2p peer may publish as origin."""
    origin_burst: float = Field(30.0, ge=1.0)
    """Bucket size of the origin limit."""
    signer_rate: float = Field(1.0, gt=0.0)
    """Announcements per second one Ethereum signer may make."""
    signer_burst: float = Field(10.0, ge=1.0)
    """Bucket size of the signer limit."""
    gossip_rate: float = Field(1000.0, gt=0.0)
    """py-libp2p's own per-peer, per-topic forwarding limit (its default, 10/s, silently stops
    forwarding a burst, our own publications included); ours above are the real limits."""
    heartbeat_s: int = Field(1, ge=1)
    """Gossipsub heartbeat (mesh maintenance, gossip); py-libp2p's default is 120 s."""
    degree: int = Field(6, ge=1)
    """Gossipsub mesh degree D (D_low = D - 2, D_high = 2 D)."""
    target_peers: int = Field(8, ge=0)
    """While connected to fewer peers, dial peers named in announcements."""
    eclipse_protection: bool = False
    """py-libp2p's mesh IP-diversity rule; off by default because every peer of a one-host devnet
    shares 127.0.0.1."""
    subscriber_queue: int = Field(256, ge=1)
    """Events a subscriber may fall behind before the oldest are dropped (the board keeps the state)."""
    max_per_topic: int = Field(4096, ge=1)
    """Signers remembered per topic on the board."""

    def with_chain_bootstrap(
        self, read: Callable[[], Sequence[str]], *, source: str = "the pool"
    ) -> DiscoveryConfig:
        """This config, with the bootstrap peers recorded on chain when none are configured (`read` is e.g.
        `PoolClient.bootstrap_peers`). Entries are untrusted: each must be a multiaddr naming its peer
        (`.../p2p/<id>`), at most `MAX_CHAIN_BOOTSTRAP` are kept, the rest are logged and skipped; a chain that
        cannot be read leaves the config as it is (discovery still starts, and the HTTP fallback remains)."""
        if self.bootstrap or not self.enabled:
            return self
        try:
            entries = list(read())
        except Exception as exc:  # an RPC failure must not stop the role: discovery is a hint
            log.warning("discovery: could not read the bootstrap peers from %s: %s", source, exc)
            return self
        good, bad = usable_bootstrap(entries)
        for entry in bad:
            log.warning(
                "discovery: skipping bootstrap entry %r from %s (not a multiaddr with /p2p/<id>)",
                str(entry)[:80],
                source,
            )
        if good:
            log.info("discovery: %d bootstrap peer(s) from %s", len(good), source)
        return self.model_copy(update={"bootstrap": good})

    @property
    def active(self) -> bool:
        """Whether the role should start discovery at all."""
        return self.enabled or bool(self.bootstrap)


MAX_CHAIN_BOOTSTRAP = 16
_MULTIADDR = re.compile(r"^(/[A-Za-z0-9._:\-]+)+$")


def usable_bootstrap(entries: Sequence[object]) -> tuple[list[str], list[object]]:
    """Split untrusted bootstrap entries into usable multiaddrs (deduplicated, at most `MAX_CHAIN_BOOTSTRAP`)
    and the rejected rest."""
    good: list[str] = []
    bad: list[object] = []
    for entry in entries:
        ok = (
            isinstance(entry, str)
            and len(entry) <= 256
            and _MULTIADDR.match(entry) is not None
            and "/p2p/" in entry
            and len(good) < MAX_CHAIN_BOOTSTRAP
        )
        if ok and entry not in good:
            good.append(str(entry))
        elif not ok:
            bad.append(entry)
    return good, bad
