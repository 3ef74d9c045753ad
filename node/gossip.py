"""The node's part in discovery: learn the run's validators and relays from libp2p gossipsub.

A node announces nothing (it listens, `identity=None`). It believes a validator announcement only from
an address holding VALIDATOR_ROLE on the pool (a cached lookup), a policy announcement only from the
run's trainer and only when the chain has the same manifest hash for that version, and a relay
announcement only from the trainer, a validator or an active, staked node of the pool (stake at risk:
a key made for free fills nothing; issue 23 item 12). Relays stay hints: whatever one serves is
verified against the trainer's signature and the chain's hash before it is used, and the node polls at
most `MAX_POLLED_RELAYS` learned relays, one per signer (the board keeps each signer's newest), those
holding the newest versions first. Explicit URLs in the config keep working with discovery off; when
libp2p reaches no one, the validators' `GET /v1/announcements` is read instead (the same checks).
"""

from __future__ import annotations

import logging
import threading
import time
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
MAX_POLLED_RELAYS = 8
"""Learned relays a node polls at most (configured ones come on top)."""


class NodeGossip:
    """Discovery for one node process (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, *, pool: Any, history: Any, domain: str, trainer: str | None) -> None:
        self.pool, self.history = pool, history
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
        return polled_relays(self.discovery.board.relays())


def polled_relays(announcements: list[Any], limit: int = MAX_POLLED_RELAYS) -> list[str]:
    """The learned relay URLs a node polls: one per signer (the board holds each signer's newest), those holding
    the newest version first (then the most recently signed), at most `limit`, each URL once."""
    ranked = sorted(announcements, key=lambda a: (max(a.body.versions, default=-1), a.sent_at), reverse=True)
    urls: list[str] = []
    for a in ranked:
        url = str(a.body.http_url).rstrip("/")
        if url not in urls:
            urls.append(url)
        if len(urls) >= limit:
            break
    return sorted(urls)
