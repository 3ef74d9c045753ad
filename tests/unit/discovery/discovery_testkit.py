"""Keys, a trust set and envelope builders for the discovery tests (no libp2p, no network)."""

from __future__ import annotations

from dataclasses import dataclass

from discovery.admission import Admission, Limits, Trust
from discovery.messages import AnnouncedBody, PolicyAnnounced, RelayAnnounced, ValidatorAnnounced
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce

DOMAIN = "prime/31337/0x5FbDB2315678afecb367f032d93F642f64180aa3/run-a"
PEER = "12D3KooWJeBihrd6fXLo9Z5ShnedY1ahcqVjAikAJZ1qQGpD4ohP"
OTHER_PEER = "12D3KooWP664SNEkbnRFsodHwgCkNdyzfJc52znynv2tRwe2xDMt"
NOW = 1_800_000_000.0


@dataclass(frozen=True)
class Keys:
    trainer: Identity
    validator: Identity
    stranger: Identity


def make_admission(trust: Trust, limits: Limits | None = None) -> Admission:
    return Admission(domain=DOMAIN, trust=trust, limits=limits, clock=lambda: NOW)


def policy(version: int = 3, peer: str = PEER, urls: tuple[str, ...] = ()) -> PolicyAnnounced:
    return PolicyAnnounced(peer_id=peer, policy_version=version, manifest_hash=b"\x11" * 32, urls=urls)


def validator_body(url: str = "http://127.0.0.1:8700", peer: str = PEER) -> ValidatorAnnounced:
    return ValidatorAnnounced(peer_id=peer, http_url=url)


def relay(versions: tuple[int, ...] = (1, 2), peer: str = PEER, url: str = "http://127.0.0.1:9100") -> RelayAnnounced:
    return RelayAnnounced(peer_id=peer, http_url=url, versions=versions)


def sign(identity: Identity, body: AnnouncedBody, *, domain: str = DOMAIN, now: float = NOW,
         nonce: int | None = None) -> bytes:
    return seal(identity, body, domain=domain, nonce=random_nonce() if nonce is None else nonce, now=now).to_bytes()
