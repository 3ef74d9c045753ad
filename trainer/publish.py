"""Handing finished checkpoints to a publisher without blocking the next training step.

`PublishHook.submit()` only enqueues; a background thread calls the publisher. The training loop
never waits on a broadcast (DESIGN: the trainer must not block on one). Failures are logged and
counted in `failures`, and the checkpoint being published is protected from rotation until done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protocol.identity import Identity
    from trainer.config import ShardcastPublish

log = logging.getLogger(__name__)

# Optimizer and RNG state are the trainer's private business: never published.
PRIVATE_FILES = ("optimizer.pt", "rng.pt", "trainer_state.json")
RECORD_RETRY_REASONS = {"timeout", "unreachable", "http", "rejected", None}
"""`ChainError.reason`s after which `publishPolicy` is tried again: the transaction did not land, through no
fault of the call (a revert such as a missing role or a paused pool is raised at once)."""
RECORD_RETRY_MAX_S = 30.0
RECONCILE_S = 5.0
"""How often the publisher checks that its recorded versions are still on chain (`Transactor.reconcile`): after a
rollback, nodes see the old version until the lost `publishPolicy`s land again, and the trainer, waiting for their
work, would send nothing that triggers the check."""
CLOSE_WAIT_S = 60.0
"""How long `close` waits for a chain reconcile pass under way to end."""


class Publisher(ABC):
    """Makes checkpoint `step` (a directory) available to the network."""

    @abstractmethod
    def publish(self, step: int, path: Path) -> None:
        """Publish; may take long (it runs off the training thread)."""

    def close(self) -> None:  # noqa: B027 - most publishers hold nothing to release
        """Release what the publisher holds (a discovery host)."""


def copy_public(checkpoint: Path, dest: Path) -> Path:
    """Copy a checkpoint's weights, config and tokenizer (not its private files) to `dest`, replacing it
    atomically: a reader sees the old directory or the new one, never a half-written one."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(checkpoint, tmp, ignore=shutil.ignore_patterns(*PRIVATE_FILES))
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    return dest


def cast_weights(source: Path, dest: Path, dtype: str) -> None:
    """Write the safetensors file `source` to `dest` with its floating tensors in `dtype` (what nodes serve);
    the checkpoint keeps the fp32 master weights."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    with safe_open(str(source), framework="pt") as fh:
        metadata = fh.metadata()
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    save_file({name: t.to(target).contiguous() if t.is_floating_point() else t for name, t in tensors.items()},
              str(dest), metadata=metadata or {"format": "pt"})


def stage_public(checkpoint: Path, staging: Path, dtype: str) -> None:
    """Put a checkpoint's public files into `staging` as they are published: weights in `dtype`, the rest as is."""
    for item in sorted(checkpoint.iterdir()):
        if item.name in PRIVATE_FILES or not item.is_file():
            continue
        if item.suffix == ".safetensors" and dtype != "float32":
            cast_weights(item, staging / item.name, dtype)
            continue
        try:  # checkpoints are immutable once written: a hard link is enough, a copy otherwise
            os.link(item, staging / item.name)
        except OSError:
            shutil.copy2(item, staging / item.name)


class LocalDirectoryPublisher(Publisher):
    """Copies each checkpoint's weights and config to `<root>/step-<n>/` atomically, then points `latest` at it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def publish(self, step: int, path: Path) -> None:
        copy_public(path, self.root / f"step-{step}")
        latest_tmp = self.root / "latest.tmp"
        latest_tmp.write_text(f"{step}\n")
        os.replace(latest_tmp, self.root / "latest")


def trainer_identity(settings: ShardcastPublish) -> Identity:
    """The key that signs manifests: a keystore (password from env or file), or a raw dev key from env."""
    from protocol.errors import ConfigError
    from protocol.identity import load_identity

    if (settings.keystore is None) == (settings.key_env is None):
        raise ConfigError("publish.type = shardcast needs exactly one of publish.keystore and publish.key_env")
    return load_identity(keystore=settings.keystore, key_env=settings.key_env, password_file=settings.password_file,
                         prompt="Trainer keystore password: ")


class ShardcastPublisher(Publisher):
    """Signs each checkpoint's weights and config into a SHARDCAST origin store as version <step>.

    The origin serving the store (`prime-relay origin --store DIR`, another process) notices the new
    version and the relays below it pull it; nodes then `prime-relay pull` it. The identity is loaded
    when the publisher is built, so a wrong password stops the trainer before its first step, not
    at its first checkpoint.
    """

    def __init__(self, settings: ShardcastPublish, identity: Identity | None = None) -> None:
        self.settings = settings
        self.identity = identity or trainer_identity(settings)
        self.store = Path(settings.store)
        self.store.mkdir(parents=True, exist_ok=True)
        self.pool: Any = None
        self.discovery: Any = None
        self._watcher: threading.Thread | None = None
        self.record_retries = 0
        """Times `publishPolicy` was tried again because a transaction did not land."""
        self.chain_seconds = 0.0
        """Seconds spent recording versions on chain (`publishPolicy`, retries included), all versions so far."""
        self._closing = threading.Event()
        self.base_dir = self.store / ".trainer-base"
        """The files of the last version published, the base of the next delta (none after a restart: an anchor)."""
        shutil.rmtree(self.base_dir, ignore_errors=True)
        self._base: Any = None
        self._anchor = -1
        self.sent_bytes: dict[int, tuple[int, int]] = {}
        """Per version: (bytes that travel, bytes of the full weights); equal for an anchor."""
        if settings.chain is not None:  # connect now: a wrong deployment stops the trainer before its first step
            from contracts.deployment import Deployment
            from contracts.journal import FileJournal
            from contracts.pool import PoolClient
            from contracts.transactor import Transactor, connect
            from protocol.errors import ConfigError

            deployment = Deployment.load(settings.chain.deployment)
            # journalled in the store the trainer keeps across restarts: a publishPolicy that a rollback of any
            # depth removed (even while the trainer was down) is sent again
            w3 = connect(settings.chain.rpc_url)
            self.pool = PoolClient(w3, deployment.pool, self.identity, Transactor(
                w3, self.identity, journal=FileJournal(self.store / "chain-journal.sqlite")))
            if not self.pool.has_role("trainer", self.identity.address):
                raise ConfigError(f"the trainer key {self.identity.address} does not hold TRAINER_ROLE on pool "
                                  f"{deployment.pool}: it cannot record versions on chain")
            self._watcher = threading.Thread(target=self._watch_chain, name="publish-reconcile", daemon=True)
            self._watcher.start()
            if settings.discovery.active:
                from discovery.admission import Trust
                from discovery.service import Discovery
                from protocol.rollout import submission_domain

                domain = submission_domain(deployment.chain_id, deployment.pool, settings.run_id)
                self.discovery = Discovery(settings.discovery, identity=self.identity, domain=domain,
                                           trust=Trust(trainer=self.identity.address), state_dir=self.store,
                                           name="trainer-discovery")
                self.discovery.start()
                log.info("discovery: announcing versions as %s on %s", self.discovery.peer_id,
                         ", ".join(self.discovery.addrs))

    def publish(self, step: int, path: Path) -> None:
        from shardcast.publisher import publish_blocking
        from shardcast.store import Store

        stored = Store(self.store, retention=self.settings.retention)
        stored.scan()
        held = stored.get(step)
        if held is not None and held.complete:
            # signed into the store before the trainer stopped, its publishPolicy not known to have landed (the
            # resumed trainer hands its last checkpoint again): recorded as stored, never signed a second time
            # (another manifest for one version would not match what relays and the chain may hold already)
            log.info("checkpoint %d is SHARDCAST version %d already (stored before a restart)", step, step)
            t0 = time.monotonic()
            try:
                self._record(step, held.manifest.content_hash())
            finally:
                self.chain_seconds += time.monotonic() - t0
            return
        staging = self.store / ".trainer-staging" / f"step-{step}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            stage_public(Path(path), staging, self.settings.dtype)
            base = self._delta_base(step)
            signed = publish_blocking(staging, self.store, identity=self.identity, run_id=self.settings.run_id,
                                      version=step, shard_size=self.settings.shard_mib << 20,
                                      dtype=self.settings.dtype, base=base)
            Store(self.store, retention=self.settings.retention).scan()  # applies retention
            self._keep_as_base(staging, signed.manifest)
            self.sent_bytes[step] = (signed.manifest.total_bytes, signed.manifest.full_bytes)
            log.info("checkpoint %d is SHARDCAST version %d, %s (%d shards, %d of %d bytes)", step,
                     signed.manifest.version, "an anchor" if signed.manifest.delta is None else
                     f"a delta against v{signed.manifest.delta.base_version}", len(signed.manifest.shards),
                     signed.manifest.total_bytes, signed.manifest.full_bytes)
            t0 = time.monotonic()
            try:
                self._record(step, signed.manifest.content_hash())
            finally:
                self.chain_seconds += time.monotonic() - t0
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                staging.parent.rmdir()  # only when empty


    def _delta_base(self, step: int) -> Any:
        """The version before, to publish `step` as a delta against; None when an anchor is due."""
        from shardcast.publisher import DeltaBase

        if self._base is None or self._base.version >= step or step - self._anchor >= self.settings.anchor_every:
            return None
        return DeltaBase(self.base_dir, self._base)

    def _keep_as_base(self, staging: Path, manifest: Any) -> None:
        """The published files (in the published dtype) become the base of the next delta."""
        shutil.rmtree(self.base_dir, ignore_errors=True)
        os.replace(staging, self.base_dir)
        self._base = manifest
        if manifest.delta is None:
            self._anchor = manifest.version

    def _record(self, version: int, manifest_hash: bytes) -> None:
        """`publishPolicy` on chain (skipped when the chain already has this version or a newer one, as after
        a resume), then the announcement. A transaction that does not land (no receipt in time, the RPC away)
        is tried again, with a doubling wait up to `RECORD_RETRY_MAX_S`, until the version is on chain or the
        publisher closes: nodes cannot use a version the chain does not show. The training loop does not wait
        (this runs on the publishing thread)."""
        if self.pool is None:
            return
        from protocol.errors import ChainError

        delay = 1.0
        while True:
            try:
                current, current_hash = self.pool.policy()
                # a fresh pool reads (0, zero hash): version 0 is not on chain yet
                if current == version and current_hash == manifest_hash:
                    log.info("version %d is on chain already", version)
                    break
                if current > version or (current == version and any(current_hash)):
                    log.warning("version %d not recorded on chain: the chain is already at v%d", version, current)
                    return
                self.pool.publish_policy(version, manifest_hash)
                log.info("version %d recorded on chain (manifest 0x%s)", version, manifest_hash.hex())
                break
            except ChainError as exc:
                if self._on_chain(version, manifest_hash):  # an earlier copy landed after all
                    log.info("version %d is on chain (%s)", version, exc)
                    break
                if exc.reason not in RECORD_RETRY_REASONS:
                    raise
                self.record_retries += 1
                log.warning("version %d is not on chain yet (%s); trying again in %.0fs", version, exc, delay)
                if self._closing.wait(delay):
                    raise ChainError(f"publishPolicy v{version}: the publisher closed before it landed",
                                     reason="closed") from exc
                delay = min(2 * delay, RECORD_RETRY_MAX_S)
        if self.discovery is not None:
            self.discovery.announce_policy(version, manifest_hash, list(self.settings.announce_urls))

    def _watch_chain(self) -> None:
        """Send again, every `RECONCILE_S`, the transactions a rollback removed (whatever its depth)."""
        from protocol.errors import ChainError

        while not self._closing.wait(RECONCILE_S):
            try:
                if resent := self.pool.tx.reconcile():
                    log.warning("a rollback removed %d of our transactions: sent again", resent)
            except ChainError as exc:
                log.warning("checking our recorded versions on chain failed (trying again in %.0f s): %s",
                            RECONCILE_S, exc)

    def _on_chain(self, version: int, manifest_hash: bytes) -> bool:
        from protocol.errors import ChainError

        try:
            current, current_hash = self.pool.policy()
        except ChainError:
            return False
        return bool(current == version and current_hash == manifest_hash)

    def close(self) -> None:
        """Stop announcing and stop writing to the chain: once this returns, no transaction of this publisher
        is sent again (a reconcile pass under way is waited for; a closed publisher whose thread went on
        resent a removed publishPolicy into whatever chain the RPC served next: CI run 45)."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=CLOSE_WAIT_S)
            if self._watcher.is_alive():
                log.warning("publisher closed while its chain reconcile pass is still running (over %.0f s)",
                            CLOSE_WAIT_S)
        if self.discovery is not None:
            self.discovery.stop()


class PublishHook:
    """A single background worker that publishes checkpoints in order."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.failures = 0
        self.published: list[int] = []
        self.seconds = 0.0
        """Seconds the publisher spent on the versions published so far (for SHARDCAST: staging, hashing and
        signing the shards, then `publishPolicy`; `chain_seconds` of the publisher is that last part)."""
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._in_flight: set[Path] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-publisher", daemon=True)
        self._thread.start()

    def submit(self, step: int, path: Path) -> None:
        """Enqueue and return at once."""
        with self._lock:
            self._in_flight.add(Path(path).resolve())
        self._queue.put((step, Path(path)))

    def in_flight(self) -> set[Path]:
        with self._lock:
            return set(self._in_flight)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, path = item
            t0 = time.monotonic()
            try:
                self.publisher.publish(step, path)
                self.seconds += time.monotonic() - t0
                self.published.append(step)
                log.info("published checkpoint %d", step)
            except Exception:  # noqa: BLE001 - a failed broadcast must not kill training; it is counted
                self.failures += 1
                log.exception("publishing checkpoint %d failed", step)
            finally:
                with self._lock:
                    self._in_flight.discard(path.resolve())

    def close(self, timeout: float | None = None) -> None:
        """Finish queued publications, then stop the worker."""
        self._queue.put(None)
        self._thread.join(timeout)
        self.publisher.close()


def publish_timing(hook: PublishHook | None) -> dict[str, float]:
    """A step's publishing totals so far: `published_versions`, `publish_seconds` (what the publisher spent on
    them) and `publish_chain_seconds` (its `publishPolicy` share); zeros without a publisher."""
    if hook is None:
        return {"published_versions": 0, "publish_seconds": 0.0, "publish_chain_seconds": 0.0}
    return {"published_versions": len(hook.published), "publish_seconds": round(hook.seconds, 3),
            "publish_chain_seconds": round(float(getattr(hook.publisher, "chain_seconds", 0.0)), 3)}
