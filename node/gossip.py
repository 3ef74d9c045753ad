"""The node's part in discovery: learn the run's validators and relays from libp2p gossipsub.

A node announces nothing (it listens, `identity=None`). It believes a validator announcement only from
an address holding VALIDATOR_ROLE on the pool (a cached lookup), a policy announcement only from the
run's trainer and only when the chain has the same manifest hash for that version, and a relay
announcement only from the trainer, a validator or an active, staked node of the pool (stake at risk:
a key made for free fills nothing; issue 23 item 12). Relays stay hints: whatever one serves is
verified against the trainer's signature and the chain's hash before it is used, and the node polls at
most `relays.polled` learned relays, one per signer (the board keeps each signer's newest). What a relay
claims to hold is cheap to say, so it ranks last (issue 35 item 8): first the relays that actually served
shards of a version this node installed and found on chain (`note_install`), newest version first, then
the claimed versions, each cut to the chain's newest; and `relays.random_slots` of the slots are drawn at
random among the other admitted relays, so a new honest relay is tried and can prove itself. Explicit URLs in the config keep working with discovery off; when
libp2p reaches no one, the validators' `GET /v1/announcements` is read instead (the same checks).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

from discovery.admission import Trust
from discovery.messages import PolicyAnnounced
from discovery.service import Discovery
from node.config import NodeConfig
from protocol.config import ShardcastWeights
from protocol.errors import ChainError, PrimeError

logger = logging.getLogger(__name__)

ROLE_CACHE_S = 60.0
FALLBACK_S = 30.0
REDRAW_S = 300.0
"""How long the randomly drawn relay slots stay the same."""
MAX_VERIFIED_RELAYS = 4096
"""Relay URLs whose served versions a node remembers (the oldest are forgotten past it)."""


class NodeGossip:
    """Discovery for one node process (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, *, pool: Any, history: Any, domain: str, trainer: str | None) -> None:
        self.pool, self.history = pool, history
        self.relay_settings = cfg.relays
        self.verified: dict[str, int] = {}
        """Relay URL -> the newest version it served shards of that this node installed and found on chain."""
        self._salt = random.getrandbits(64)  # this process's own draws: no one can predict which relays it tries
        self._roles: dict[str, tuple[bool, float]] = {}
        self._staked: dict[str, tuple[bool, float]] = {}
        self._lock = threading.Lock()
        self._fallback_at = 0.0
        self.seeds: list[str] = list(cfg.validators)
        """URLs whose `/v1/announcements` are read when gossip brings nothing (the configured validators)."""
        config = cfg.discovery.with_chain_bootstrap(pool.bootstrap_peers)  # none configured: the pool's record
        self.discovery = Discovery(config, identity=None, domain=domain, state_dir=cfg.state_dir,
                                   trust=Trust(trainer=trainer, is_validator=self.is_validator,
                                               relay_signer=self.is_staked, policy_check=self.on_chain),
                                   name="node-discovery")

    @staticmethod
    def trainer_of(cfg: NodeConfig, deployment_trainers: list[str]) -> str | None:
        """The run's trainer: the manifest signer of shardcast weights, else the deployment's only trainer."""
        if isinstance(cfg.weights, ShardcastWeights):
            return cfg.weights.trainer
        return deployment_trainers[0] if len(deployment_trainers) == 1 else None

    def is_validator(self, address: str) -> bool:
        """VALIDATOR_ROLE on the pool, cached for a minute (one RPC per new address, not per message)."""
        return self._cached(self._roles, address, "the validator role",
                            lambda: bool(self.pool.has_role("validator", address)))

    def is_staked(self, address: str) -> bool:
        """An active node of the pool (staked, not leaving or ejected): who may announce a relay besides the
        trainer and validators. Cached like `is_validator`."""
        return self._cached(self._staked, address, "the stake", lambda: bool(self.pool.is_active(address)))

    def _cached(self, table: dict[str, tuple[bool, float]], address: str, what: str, ask: Any) -> bool:
        now = time.monotonic()
        with self._lock:
            cached = table.get(address)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            holds = bool(ask())
        except ChainError as exc:
            logger.warning("discovery: cannot check %s of %s: %s", what, address, exc)
            return False
        with self._lock:
            if len(table) > 4096:
                table.clear()
            table[address] = (holds, now + ROLE_CACHE_S)
        return holds

    def on_chain(self, body: PolicyAnnounced) -> bool:
        return bool(self.history.manifest_hash(body.policy_version) == bytes(body.manifest_hash))

    def start(self) -> None:
        self.discovery.start()
        logger.info("discovery: listening as %s on %s (bootstrap: %s)", self.discovery.peer_id,
                    ", ".join(self.discovery.addrs), ", ".join(self.discovery.config.bootstrap) or "none")

    def stop(self) -> None:
        self.discovery.stop()

    def _fallback(self) -> None:
        """With no validator learnt over gossip, read the seeds' `/v1/announcements` (at most every 30 s)."""
        if self.discovery.board.validators() or not self.seeds or time.monotonic() < self._fallback_at:
            return
        self._fallback_at = time.monotonic() + FALLBACK_S
        for url in self.seeds:
            try:
                self.discovery.fetch(url)
            except PrimeError as exc:
                logger.info("discovery: %s/v1/announcements: %s", url, exc)

    def validator_urls(self) -> list[str]:
        self._fallback()
        return sorted({str(a.body.http_url).rstrip("/") for a in self.discovery.board.validators()})  # type: ignore[union-attr]

    def relay_urls(self) -> list[str]:
        chain_version = self.history.current()  # as of the last refresh: a cached read
        with self._lock:
            verified = dict(self.verified)
        s = self.relay_settings
        # the random slots are drawn anew every REDRAW_S, not per read: the follower rebuilds its client when the set
        # changes, and a relay needs a while to serve a version and prove itself
        rng = random.Random(f"{self._salt}:{int(time.time() // REDRAW_S)}")
        return polled_relays(self.discovery.board.relays(), s.polled, verified=verified, chain_version=chain_version,
                             random_slots=s.random_slots, rng=rng)

    def note_install(self, result: Any) -> None:
        """A pull installed `result.version` (a `shardcast.client.PullResult`): the relays that served verified
        shards of it rank by it, once the chain records the same manifest hash for that version."""
        if not result.served or self.history.manifest_hash(result.version) != result.manifest.content_hash():
            return
        with self._lock:
            for url in result.served:
                url = url.rstrip("/")
                self.verified[url] = max(self.verified.get(url, -1), result.version)
            while len(self.verified) > MAX_VERIFIED_RELAYS:
                del self.verified[min(self.verified, key=self.verified.__getitem__)]


def polled_relays(announcements: list[Any], limit: int, *, verified: Mapping[str, int] | None = None,
                  chain_version: int | None = None, random_slots: int = 0,
                  rng: random.Random | None = None) -> list[str]:
    """The learned relay URLs a node polls (sorted, each once, at most `limit`): one per signer (the board holds
    each signer's newest), `limit - random_slots` of them by rank, the rest drawn at random from the others.

    Rank: the newest version the relay actually served (`verified`: URL -> version, from `note_install`), then
    its newest claimed version cut to `chain_version` (None: nothing on chain, so no claim counts), then the most
    recently signed. A key announcing version 2**63-1 thus ranks like an honest relay that has not served yet, and
    below every one that has."""
    verified = verified or {}
    ceiling = -1 if chain_version is None else chain_version

    def rank(a: Any) -> tuple[int, int, float]:
        url = str(a.body.http_url).rstrip("/")
        return verified.get(url, -1), min(max(a.body.versions, default=-1), ceiling), a.sent_at

    ranked: list[str] = []
    for a in sorted(announcements, key=rank, reverse=True):
        url = str(a.body.http_url).rstrip("/")
        if url not in ranked:
            ranked.append(url)
    chosen = ranked[:max(0, limit - random_slots)]
    rest = ranked[len(chosen):]
    chosen += (rng or random.Random()).sample(rest, min(len(rest), limit - len(chosen)))
    return sorted(chosen)
