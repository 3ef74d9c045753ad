"""One validator process: its parts built from the config, and the background loops that drive them.

The core that decides pay and slashing is five rooms with one job each, wired by `validator.core.Core`:
`validator.assignment` (work keys, tasks, seeds, who checks what, counter order), `validator.intake` (the HTTP
side: admission, refusals, cheap checks), `validator.checker` (the model thread), `validator.judge` (pure:
measurements in, verdict out) and `validator.verdicts` (signing, evidence, feed items); `validator.guard` and
`validator.grading` serve the checker.

Threads: `chain` (new pool events every `chain.poll_s`), `checker` (the model stage), `reporter`
(the outbox onto the chain), `feed` (Parquet files for a trainer on a shared disk), the weights
follower, and with `peers`: `peers` (probes), `pool-notes` (the peers' signed notes, `validator.poolview`)
and `notes-push` (ours, sent to them at once when a hard verdict is pending here, `validator.notes`). The HTTP
app (`validator.app`) only calls into `Intake.receive` and reads the ledger.
On start every unfinished row is picked up where it was: received rows are re-checked (the leases this
process held when it was killed are freed at start), decided rows are reported, unwritten feed items are written.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from contracts.deployment import Deployment
from contracts.journal import FileJournal
from contracts.pool import PoolClient
from contracts.transactor import Transactor, connect
from protocol.envelope import Envelope
from protocol.episodes import EpisodeFeedItem
from protocol.errors import ConfigError
from protocol.identity import Identity, load_identity
from protocol.nonce import NonceCounter
from protocol.replay import ReplayGuard
from protocol.rollout import FeedItem, submission_domain
from protocol.rollout_files import feed_groups, write_rollouts
from validator.appeals import AppealDesk
from validator.chainview import ChainView
from validator.config import ValidatorConfig
from validator.core import Core
from validator.crosscheck import CrossCheck
from validator.ledger import Ledger
from validator.notes import Notes, NotesPusher
from validator.peers import PeerWatch
from validator.poolview import PoolView
from validator.reporter import Reporter
from validator.weights import WeightStore

log = logging.getLogger(__name__)

PRUNE_MARGIN_S = 3600.0
"""Envelopes are kept this long past the chain's invalidation window (the pool clock and ours may differ)."""
REFUSALS_FLUSH_S = 1.0
"""Refused requests are counted in memory and written this often (`Ledger.count_refusal`): one commit a second, not
one per refusal."""


class Service:
    """Everything a validator runs, minus HTTP."""

    def __init__(self, cfg: ValidatorConfig, identity: Identity | None = None) -> None:
        self.cfg = cfg
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity or load_identity(
            keystore=cfg.key.keystore, key_env=cfg.key.key_env, password_env=cfg.key.password_env,
            password_file=cfg.key.password_file)
        if cfg.chain.deployment is None:
            raise ConfigError("chain.deployment is required (the deployment.json written by prime-chain)")
        self.deployment = deployment = Deployment.load(cfg.chain.deployment)
        # Our transactions are journalled with the ledger (a restart after kill -9 still sends again what a
        # rollback of any depth removed: rows marked reported on a receipt that left the chain).
        self.pool = PoolClient(connect(cfg.chain.rpc_url), deployment.pool, self.identity,
                               Transactor(connect(cfg.chain.rpc_url), self.identity,
                                          journal=FileJournal(cfg.state_dir / "transactions.sqlite")))
        self.chain = ChainView(self.pool, deployment.start_block)
        self.chain.refresh()  # fail fast when the chain is unreachable
        check_reach(cfg, self.chain)
        self.domain = submission_domain(deployment.chain_id, deployment.pool, cfg.run.run_id)
        # The owner of this process's leases, the same after a restart (a state dir is one process's):
        # rows it was checking when it was killed are taken up again at once, not when their leases end.
        self.ledger = Ledger.open(dsn=cfg.ledger_dsn, path=cfg.state_dir / "ledger.sqlite",
                                  owner=f"{socket.gethostname()}:{cfg.state_dir.resolve()}")
        if freed := self.ledger.recover():
            log.info("ledger: %d submissions were being checked when this validator last stopped; checking "
                     "them again", freed)
        self.replay = ReplayGuard(cfg.state_dir / "replay.sqlite")
        self.nonces = NonceCounter(cfg.state_dir / "nonces.sqlite")
        self.weights = WeightStore(cfg, self.chain.manifest_hash, self.chain.current_version)
        self.peers = PeerWatch(cfg.peers, identity=self.identity, domain=self.domain,
                               failover_after_s=cfg.failover_after_s)
        self.core = Core.build(cfg, self.identity, self.ledger, self.chain, self.weights, domain=self.domain,
                               replay_guard=self.replay, nonces=self.nonces, peers=self.peers)
        self.notes = Notes(cfg, self.identity, self.ledger, current_version=self.chain.current_version,
                           domain=self.domain)
        self.pool_view: PoolView | None = None
        if cfg.peers and cfg.pool_notes.enabled:  # what the peers know about a node counts here too
            self.pool_view = PoolView(cfg.pool_notes, ledger=self.ledger, domain=self.domain, me=self.identity.address,
                                 peers=self.peers.urls, validators=self.core.assignment.validators,
                                 invalidation_window=lambda: self.chain.invalidation_window, stats=self.core.stats)
            self.core.intake.admission.pool = self.pool_view
            self.core.checker.pool = self.pool_view
        self.notes_pusher: NotesPusher | None = None
        if cfg.peers and cfg.pool_notes.push:  # a hold decided here reaches the peers at once, not at their next fetch
            self.notes_pusher = NotesPusher(self.notes, peers=self.peers.urls, timeout_s=cfg.pool_notes.timeout_s,
                                            stats=self.core.stats)
        self.crosscheck: CrossCheck | None = None
        if cfg.peers and cfg.pool_notes.crosscheck:  # one assignment's payloads split between validators
            self.crosscheck = CrossCheck(
                self.pool, deployment.start_block, ledger=self.ledger, verdicts=self.core.verdicts,
                me=self.identity.address, peers=self.peers.urls, domain=self.domain,
                max_submission_bytes=cfg.max_submission_bytes, timeout_s=cfg.pool_notes.timeout_s,
                invalidation_window=lambda: self.chain.invalidation_window, stats=self.core.stats)
        self.appeals = AppealDesk(cfg, self.identity, self.ledger, self.chain,
                                  self.pool if cfg.reporter.enabled else None, self.core, self.weights,
                                  domain=self.domain, replay_guard=self.replay, nonces=self.nonces)
        self.reporter = Reporter(self.ledger, self.pool if cfg.reporter.enabled else None,
                                 batch=cfg.reporter.batch, hold_hard_s=cfg.systemic.window_s,
                                 retry_backoff_s=cfg.reporter.retry_backoff_s, max_backoff_s=cfg.reporter.max_backoff_s)
        self.feed_files = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wake = threading.Event()

    def ready(self) -> tuple[bool, str]:
        """Ready when the chain is readable, a policy is published and its weights are loaded."""
        if self.chain.last_error:
            return False, f"chain: {self.chain.last_error}"
        current = self.chain.current_version()
        if current is None:
            return False, "no policy version published on chain yet"
        try:
            self.weights.get(current)
        except Exception as exc:  # noqa: BLE001 - readiness reports any reason, it never raises
            return False, f"weights of v{current}: {exc}"
        return True, f"checking v{max(0, current - self.cfg.run.async_level)}..v{current}"

    def wake(self) -> None:
        """A submission arrived: the checker need not wait for its next poll."""
        self._wake.set()

    def _loop(self, name: str, every: float, step: Callable[[], object], wake: threading.Event | None = None) -> None:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    step()
                except Exception:  # noqa: BLE001 - a loop logs and retries; it must never die silently
                    log.exception("%s loop failed; retrying", name)
                if wake is not None:
                    wake.wait(every)
                    wake.clear()
                else:
                    self._stop.wait(every)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _check_step(self) -> None:
        while not self._stop.is_set() and self.core.checker.check_pending():
            pass
        self.core.assignment.count_holes()  # cheap unless a version just left the async window

    def prune_envelopes(self, now: float | None = None) -> int:
        """Drop the envelopes whose verdict the chain can no longer change (`Ledger.prune_envelopes`); nothing
        before the chain's invalidation window is known. Returns how many."""
        window = self.chain.invalidation_window
        if window is None:
            return 0
        t = time.time() if now is None else now
        n = self.ledger.prune_envelopes(reported_before=t - window - PRUNE_MARGIN_S)
        if n:
            log.info("pruned %d stored envelopes older than the invalidation window", n)
        return n

    def write_feed(self) -> int:
        """Write accepted submissions not yet on disk as Parquet rollout files (atomic rename)."""
        if self.cfg.feed_dir is None:
            return 0
        self.cfg.feed_dir.mkdir(parents=True, exist_ok=True)
        n = 0
        for seq, created_at, _key, item in self.ledger.unwritten_feed(256):
            envelope = Envelope.model_validate_json(item)
            kinds = {(t.kind, t.version): t for t in (FeedItem, EpisodeFeedItem)}
            kind = kinds.get((envelope.kind, envelope.version))
            if kind is None:
                # written by an older validator (a v1 item carried the node's claimed logprobs): never a file
                log.warning("feed item %d is %s v%d, not v%d or v%d: no rollout file", seq, envelope.kind,
                            envelope.version, FeedItem.version, EpisodeFeedItem.version)
                self.ledger.mark_written(seq)
                continue
            body = kind.model_validate(envelope.body)
            samples = [s for g in feed_groups(body) for s in g]
            name = f"{int(created_at * 1000):013d}-{self.identity.address}-{seq:010d}.parquet"
            write_rollouts(Path(self.cfg.feed_dir) / name, samples)
            self.ledger.mark_written(seq)
            n += 1
        self.feed_files += n
        return n

    def start(self) -> None:
        import torch

        torch.set_num_threads(self.cfg.threads)
        self.weights.start()
        self._loop("chain", self.cfg.chain.poll_s, self.chain.try_refresh)
        self._loop("checker", 0.5, self._check_step, self._wake)
        self._loop("reporter", self.cfg.reporter.interval_s, self.reporter.drain)  # without a pool: ledger only
        self._loop("feed", 0.5, self.write_feed)
        self._loop("prune", 60.0, self.prune_envelopes)
        self._loop("refusals", REFUSALS_FLUSH_S, self.ledger.flush_refusals)
        if self.cfg.appeals.enabled and self.cfg.reporter.enabled:
            self._loop("appeals", self.cfg.reporter.interval_s * 5, self.appeals.resolve_pending)
        if self.cfg.peers:
            self._loop("peers", min(5.0, self.cfg.failover_after_s / 3), self.peers.probe)
        if self.pool_view is not None:
            self._loop("pool-notes", self.cfg.pool_notes.interval_s, self.pool_view.poll)
        if self.notes_pusher is not None:
            self._loop("notes-push", self.cfg.pool_notes.push_check_s, self.notes_pusher.check)
        if self.crosscheck is not None:
            self._loop("crosscheck", self.cfg.pool_notes.crosscheck_s, self.crosscheck.step)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.weights.stop()
        for t in self._threads:
            t.join(timeout=30)
        self.ledger.close()
        self.peers.close()
        if self.pool_view is not None:
            self.pool_view.close()
        if self.notes_pusher is not None:
            self.notes_pusher.close()
        if self.crosscheck is not None:
            self.crosscheck.close()
        self.replay.close()
        self.nonces.close()


def check_reach(cfg: ValidatorConfig, chain: ChainView) -> None:
    """Refuse a configuration whose reports can miss the chain's deadlines: a hard verdict is held for
    `systemic.window_s` and then, while the RPC fails, retried after up to `reporter.max_backoff_s`; if that can
    reach the pool's invalidation window (the chain refuses the invalidation) or its unbonding period (the node
    has left with its stake), a cheat caught here is never slashed. `ConfigError` naming both sides."""
    if not cfg.reporter.enabled or chain.invalidation_window is None or chain.unbonding_period is None:
        return
    reach = cfg.systemic.window_s + cfg.reporter.max_backoff_s
    for name, limit in (("invalidation window", chain.invalidation_window),
                        ("unbonding period", chain.unbonding_period)):
        if reach >= limit:
            raise ConfigError(
                f"systemic.window_s ({cfg.systemic.window_s:g} s) + reporter.max_backoff_s "
                f"({cfg.reporter.max_backoff_s:g} s) = {reach:g} s reaches the pool's {name} ({limit} s): a hard "
                f"verdict held and retried that long could never be slashed; lower them below {limit} s")
