"""The weights each policy version is checked with.

`static`: the base model for every version (tests, benchmarks, a frozen policy). `shardcast`: a
background thread follows the relays (`shardcast.Client.follow`), and a version is usable only when
its installed manifest's `content_hash` equals the hash the chain recorded for it; versions up to
`base_version` are the base model. Loaded models are kept for the versions inside the async window
(least recently used evicted), so checking never waits for a load it already did.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.errors import PrimeError
from protocol.model_spec import HFModelSpec

if TYPE_CHECKING:
    from models.loading import LoadedModel
    from validator.config import ShardcastWeights, ValidatorConfig

log = logging.getLogger(__name__)


class WeightsUnavailable(PrimeError):
    """The weights of a policy version are not (yet) here: our problem, never the node's."""

    code = "weights_unavailable"


class WeightStore:
    """Loaded models by policy version (see the module docstring)."""

    def __init__(self, cfg: ValidatorConfig, manifest_hash: Callable[[int], bytes | None]) -> None:
        from models.loading import load

        self._cfg = cfg
        self._load = load
        self._manifest_hash = manifest_hash
        self.base = load(cfg.model, dtype=cfg.dtype)
        self._cache: OrderedDict[int, LoadedModel] = OrderedDict()
        self._keep = cfg.run.async_level + 1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dir = cfg.state_dir / "weights"

    def get(self, version: int) -> LoadedModel:
        """The model of `version`; `WeightsUnavailable` when it is not installed and verified yet."""
        from validator.config import ShardcastWeights

        source = self._cfg.weights
        if not isinstance(source, ShardcastWeights) or version <= source.base_version:
            return self.base
        with self._lock:
            if version in self._cache:
                self._cache.move_to_end(version)
                return self._cache[version]
        path = self.dir / f"v{version}"
        manifest_file = self.dir / "manifests" / f"{version}.json"
        if not path.is_dir() or not manifest_file.is_file():
            raise WeightsUnavailable(f"policy version {version} is not installed yet")
        try:
            self._check_manifest(version, manifest_file, source)
            loaded = self._load(HFModelSpec(name_or_path=str(path)), dtype=self._cfg.dtype)
        except WeightsUnavailable:
            raise
        except PrimeError as exc:  # a bad install or a checkpoint that does not load is ours to fix
            raise WeightsUnavailable(f"policy version {version}: {exc}") from exc
        with self._lock:
            self._cache[version] = loaded
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return loaded

    def _check_manifest(self, version: int, manifest_file: Path, source: ShardcastWeights) -> None:
        from shardcast.manifest import SignedManifest

        signed = SignedManifest.parse(manifest_file.read_bytes())
        signed.verify(trainer=source.trainer)
        want = self._manifest_hash(version)
        if want is None:
            raise WeightsUnavailable(f"policy version {version} is not published on chain yet")
        if signed.manifest.content_hash() != want:
            raise WeightsUnavailable(f"installed v{version} does not match the manifest hash on chain")

    def start(self) -> None:
        """Follow the relays in a background thread (shardcast source only)."""
        from validator.config import ShardcastWeights

        source = self._cfg.weights
        if not isinstance(source, ShardcastWeights) or not source.relays:
            return
        self._thread = threading.Thread(target=self._follow, args=(source,), name="weights", daemon=True)
        self._thread.start()

    def _follow(self, source: ShardcastWeights) -> None:
        from shardcast.client import Client

        async def run() -> None:
            client = Client(source.relays, trainer=source.trainer, out_dir=self.dir, run_id=self._cfg.run.run_id,
                            keep=self._keep + 1, progress=False)
            async for result in client.follow(poll_s=5.0):
                log.info("weights: installed v%d (%d shards fetched)", result.version, result.fetched_shards)

        async def until_stopped() -> None:
            follow = asyncio.ensure_future(run())
            while not self._stop.is_set() and not follow.done():
                await asyncio.sleep(0.2)
            follow.cancel()
            try:
                await follow
            except asyncio.CancelledError:
                pass

        while not self._stop.is_set():
            try:
                asyncio.run(until_stopped())
            except PrimeError as exc:
                log.warning("weights: following the relays failed (retrying): %s", exc)
            self._stop.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
