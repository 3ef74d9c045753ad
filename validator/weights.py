"""The weights each policy version is checked with.

`static`: the base model for every version (tests, benchmarks, a frozen policy). `shardcast`: a
background thread follows the relays (`shardcast.follower.Follower`), and a version is usable only
when its installed manifest is the trainer's and its `content_hash` equals the hash the chain
recorded; versions up to `base_version` are the base model. With `base_version = -1` (a run started from a
trained checkpoint) no version is: version 0 is checked only with the weights pulled for it, and until they are
here its work waits (`WeightsUnavailable`: our problem, never a slash); the base weights are then not even
loaded. Loaded models are kept for the versions inside the async window (least recently used evicted), so
checking never waits for a load it already did.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.config import ShardcastWeights
from protocol.errors import PrimeError
from protocol.model_spec import HFModelSpec
from shardcast.follower import Follower

if TYPE_CHECKING:
    from models.loading import LoadedModel
    from validator.config import ValidatorConfig

log = logging.getLogger(__name__)


class WeightsUnavailable(PrimeError):
    """The weights of a policy version are not (yet) here: our problem, never the node's."""

    code = "weights_unavailable"


class WeightStore:
    """Loaded models by policy version (see the module docstring)."""

    def __init__(self, cfg: ValidatorConfig, manifest_hash: Callable[[int], bytes | None],
                 current: Callable[[], int | None] | None = None) -> None:
        from models.loading import load

        self._cfg = cfg
        self._load = load
        self._manifest_hash = manifest_hash
        source = cfg.weights
        self._base_version = source.base_version if isinstance(source, ShardcastWeights) else None
        # with no base version (-1) nothing is checked with the base weights: they are not loaded at all
        self.base: LoadedModel | None = (None if self._base_version is not None and self._base_version < 0
                                         else load(cfg.model, dtype=cfg.dtype))
        self._cache: OrderedDict[int, LoadedModel] = OrderedDict()
        self._keep = cfg.run.async_level + 1
        self._lock = threading.Lock()
        self.dir = cfg.state_dir / "weights"
        self._follower: Follower | None = None
        if isinstance(source, ShardcastWeights):
            self._follower = Follower(source.relays, trainer=source.trainer, out_dir=self.dir, run_id=cfg.run.run_id,
                                      keep=self._keep + 1, expected=manifest_hash,
                                      wanted=None if current is None else lambda: _above(current(), source.base_version))

    def get(self, version: int) -> LoadedModel:
        """The model of `version`; `WeightsUnavailable` when it is not installed and verified yet."""
        if self._follower is None or self._base_version is None or version <= self._base_version:
            assert self.base is not None  # loaded unless base_version < 0, and then no version gets here
            return self.base
        with self._lock:
            if version in self._cache:
                self._cache.move_to_end(version)
                return self._cache[version]
        try:
            path = self._follower.verified(version, self._manifest_hash(version))
            loaded = self._load(HFModelSpec(name_or_path=str(path)), dtype=self._cfg.dtype)
        except PrimeError as exc:  # not there yet, not the chain's, or does not load: ours to fix, never the node's
            raise WeightsUnavailable(f"policy version {version}: {exc}") from exc
        with self._lock:
            self._cache[version] = loaded
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return loaded

    def start(self) -> None:
        """Follow the relays in a background thread (shardcast source only)."""
        if self._follower is not None:
            self._follower.start()

    def stop(self) -> None:
        if self._follower is not None:
            self._follower.stop()


def _above(version: int | None, base_version: int) -> int | None:
    """`version` when the relays have to provide it (above the base versions), else None."""
    return version if version is not None and version > base_version else None
