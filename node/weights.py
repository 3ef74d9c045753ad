"""Which policy version the node generates with, and the engine that holds its weights.

The chain is authoritative: `PolicyPublished(version, manifestHash)` events say which versions exist
and what each one's manifest hashes to. With the `shardcast` source a background thread follows the
relays (`shardcast.follower.Follower`); a version is used only when its installed manifest is the
trainer's and hashes to the chain's, and the newest such version is loaded into a new engine that
replaces the old one in one assignment (a batch in flight keeps the engine it started with).

The node never generates with weights older than the async window allows: when the newest usable
version is more than `async_level` behind the chain's, `select()` says why and the worker waits
(the validator would drop that work as stale anyway). Versions up to `base_version` are the base
model (the run's `model`); with the `static` source every version is. With `base_version = -1` (a run
started from a trained checkpoint) none is: version 0 is pulled and checked like any other, and until it
is here the node waits; it never loads the base weights, let alone generates with them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contracts.policy import PolicyHistory
from node.engines import InferenceEngine
from protocol.config import ShardcastWeights, WeightSource
from protocol.errors import ChainError, PrimeError
from protocol.model_spec import HFModelSpec, ModelSpec
from protocol.run import RunSpec
from shardcast.client import PullResult
from shardcast.follower import Follower, VersionUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """The version to generate with: its number, the chain's manifest hash of it, and the engine."""

    version: int
    manifest_hash: bytes
    engine: InferenceEngine


class Waiting(PrimeError):
    """No policy version can be used right now (the message says why; the worker waits and asks again)."""

    code = "waiting_for_policy"


class PolicyWeights:
    """The node's weights by policy version (see the module docstring)."""

    def __init__(self, source: WeightSource, model: ModelSpec, run: RunSpec, history: PolicyHistory,
                 make_engine: Callable[[ModelSpec], InferenceEngine], weights_dir: Path, *,
                 progress: bool | None = None, poll_s: float = 2.0,
                 learned_relays: Callable[[], list[str]] | None = None,
                 on_install: Callable[[PullResult], None] | None = None) -> None:
        self.source = source
        self.model = model
        self.run = run
        self.history = history
        self._make_engine = make_engine
        self.poll_s = poll_s
        self._refreshed = -float("inf")
        self.base_version = source.base_version if isinstance(source, ShardcastWeights) else None
        """Versions up to this one run on `base` (None: every version, the `static` source; -1: none)."""
        self.base: InferenceEngine | None = (None if self.base_version is not None and self.base_version < 0
                                             else make_engine(model))
        """The run's model (None when no version runs on it: its weights are not even loaded)."""
        self.loaded_version: int | None = None
        """The installed version whose weights `_engine` holds (None: the base model)."""
        self._engine = self.base
        self._lock = threading.Lock()
        self.follower: Follower | None = None
        if isinstance(source, ShardcastWeights):
            self.follower = Follower(source.relays, trainer=source.trainer, out_dir=weights_dir, run_id=run.run_id,
                                     keep=run.async_level + 2, progress=progress, wanted=self._wanted,
                                     learned=learned_relays, on_install=on_install,
                                     poll_s=poll_s, expected=self.history.manifest_hash)

    def _wanted(self) -> int | None:
        """The chain's version, for the follower to pull by number (versions up to `base_version` need no pull)."""
        current = self.history.current()
        return None if current is None or self._is_base(current) else current

    def _is_base(self, version: int) -> bool:
        """Whether `version` runs on the base model rather than weights pulled over the relays."""
        return self.base_version is None or version <= self.base_version

    def start(self) -> None:
        if self.follower is not None:
            if not self.follower.relays and self.follower.learned is None:
                logger.warning("weights: no relays configured; only versions already in %s can be used",
                               self.follower.out_dir)
            self.follower.start()

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()

    def relays(self) -> list[str]:
        return self.follower.sources() if self.follower is not None else []

    def select(self) -> Policy:
        """The newest usable version inside the async window, its weights loaded; `Waiting` if none."""
        now = time.monotonic()
        if now - self._refreshed >= self.poll_s or self.history.current() is None:  # at most one read per poll_s
            try:
                self.history.refresh()
                self._refreshed = now
            except ChainError as exc:  # the last view stays good; a stale one is caught by the window below
                logger.warning("chain: reading policy versions failed (%s); using what was read before", exc)
        current = self.history.current()
        if current is None:
            raise Waiting("no policy version published on chain yet")
        oldest = max(0, current - self.run.async_level)
        if self.follower is None:  # static: every version is the base model
            assert self.base is not None  # built unless base_version < 0, which only the shardcast source has
            return self._policy(current, self.base)
        reasons: list[str] = []
        for version in sorted((v for v in self.follower.installed() if oldest <= v <= current), reverse=True):
            if self._is_base(version):
                break
            try:
                path = self.follower.verified(version, self.history.manifest_hash(version))
            except VersionUnavailable as exc:
                reasons.append(str(exc))
                continue
            return self._policy(version, self._engine_for(version, path))
        base = None if self.base_version is None or self.base_version < 0 else min(current, self.base_version)
        if base is not None and self.base is not None and oldest <= base and self.history.manifest_hash(base) is not None:
            return self._policy(base, self.base)
        newest = self.follower.installed()
        raise Waiting(
            f"the chain is at v{current} and the async window (async_level {self.run.async_level}) allows v{oldest} "
            f"or newer; installed: {', '.join(f'v{v}' for v in newest) or 'nothing'}"
            + (f" ({'; '.join(reasons)})" if reasons else "")
            + (f"; relays: {self.follower.last_error}" if self.follower.last_error else "")
            + "; waiting for the relays")

    def _policy(self, version: int, engine: InferenceEngine) -> Policy:
        manifest = self.history.manifest_hash(version)
        if manifest is None:
            raise Waiting(f"v{version} has no manifest hash on chain")
        return Policy(version, manifest, engine)

    def _engine_for(self, version: int, path: Path) -> InferenceEngine:
        with self._lock:
            if self.loaded_version == version and self._engine is not None:
                return self._engine
        logger.info("weights: loading v%d from %s", version, path)
        try:
            engine = self._make_engine(HFModelSpec(name_or_path=str(path)))
        except PrimeError as exc:
            raise Waiting(f"v{version} is installed but does not load: {exc}") from exc
        with self._lock:  # swapped in one assignment; a batch in flight keeps the engine it began with
            self._engine, self.loaded_version = engine, version
        logger.info("weights: now generating with v%d", version)
        return engine
