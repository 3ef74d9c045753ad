"""The validator's part in discovery: announce its HTTP endpoint over libp2p gossipsub, keep the run's
announcements (policy versions, validators, relays) on a board served at `GET /v1/announcements`.

Built by `validator.app.build_app` only when `discovery.enabled` or `discovery.bootstrap` is set, and
run for the life of the HTTP server; a validator without it keeps working from its explicit URLs.
Who is believed comes from the chain: VALIDATOR_ROLE holders (cached lookups, off gossip's thread),
and policy versions only from the run's trainer and only when `PolicyPublished` has the same
manifest hash (as of this validator's chain view).
"""

from __future__ import annotations

import logging
import threading
import time

from discovery.admission import Trust
from discovery.messages import PolicyAnnounced
from discovery.service import Discovery
from protocol.config import ShardcastWeights
from protocol.errors import ChainError, PrimeError
from protocol.identity import checksum
from validator.config import ValidatorConfig
from validator.service import Service

log = logging.getLogger(__name__)

ROLE_CACHE_S = 60.0


def announced_url(cfg: ValidatorConfig) -> str | None:
    """The URL to announce: `public_url`, else http://host:port when both are reachable values."""
    if cfg.public_url:
        return cfg.public_url.rstrip("/")
    if cfg.port == 0 or cfg.host in ("0.0.0.0", "::", ""):
        return None
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    return f"http://{host}:{cfg.port}"


def run_trainer(service: Service) -> str | None:
    """The run's trainer: the key that signs manifests (shardcast weights), else the deployment's only trainer."""
    weights = service.cfg.weights
    if isinstance(weights, ShardcastWeights):
        return checksum(weights.trainer)
    trainers = service.deployment.trainers
    return checksum(trainers[0]) if len(trainers) == 1 else None


class Announcer:
    """Discovery for one validator process (see the module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.url = announced_url(service.cfg)
        self._roles: dict[str, tuple[bool, float]] = {}
        self._lock = threading.Lock()
        # relays: besides the trainer and validators, an active staked node (the chain view's cached set), as
        # nodes believe them, so that relay announcements the nodes accept pass through validators too
        trust = Trust(trainer=run_trainer(service), is_validator=self.is_validator,
                      relay_signer=service.chain.node_active, policy_check=self.on_chain)
        config = service.cfg.discovery.with_chain_bootstrap(service.pool.bootstrap_peers)  # else: the pool's record
        self.discovery = Discovery(config, identity=service.identity, domain=service.domain,
                                   trust=trust, state_dir=service.cfg.state_dir, name="validator-discovery")

    def is_validator(self, address: str) -> bool:
        """VALIDATOR_ROLE on the pool, cached for a minute (one RPC per new address, not per message)."""
        now = time.monotonic()
        with self._lock:
            cached = self._roles.get(address)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            holds = self.service.pool.has_role("validator", address)
        except ChainError as exc:
            log.warning("cannot check the validator role of %s: %s", address, exc)
            return False  # not cached: the next announcement asks again
        with self._lock:
            self._roles[address] = (holds, now + ROLE_CACHE_S)
        return holds

    def on_chain(self, body: PolicyAnnounced) -> bool:
        """The announced version is on chain with the same manifest hash (our chain view may lag by
        `chain.poll_s`; the trainer re-announces, so a lagging refusal is repaired)."""
        return self.service.chain.manifest_hash(body.policy_version) == body.manifest_hash

    def start(self) -> None:
        self.discovery.start()
        log.info("discovery: libp2p peer %s on %s", self.discovery.peer_id, self.discovery.addrs)
        if self.url is None:
            log.warning("discovery: not announcing this validator (set public_url; port 0 or a wildcard host "
                        "is not an address others can use)")
            return
        try:
            self.discovery.announce_validator(self.url)
        except PrimeError as exc:  # e.g. the role is not granted yet: re-announcement keeps trying
            log.warning("discovery: our announcement was refused (%s); retrying every %.0f s", exc,
                        self.discovery.config.reannounce_s)

    def stop(self) -> None:
        self.discovery.stop()
