"""How a client gets a delta version (shardcast/README.md, "Deltas"): through its base chain (the base held here, or
pulled first, down to an anchor) or as the version's full weights, whichever is cheaper and can be had; the delta
applied to the base held and checked against the signed full-weight table; and which installed versions a delta
may be applied to (their signed manifests in `out_dir/manifests/`). `DeltaRoute` is a part of `Client`
(shardcast/client.py), which it relies on for the manifests and the pulls themselves."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from protocol.errors import RelayError
from shardcast.delta import apply_delta
from shardcast.errors import DeltaBaseError, DeltaError, ManifestError, StorageError
from shardcast.manifest import Manifest, SignedManifest
from shardcast.sources import SourceBoard
from shardcast.staging import missing_files
from shardcast.transfer import INDEX_TIMEOUT_S

log = logging.getLogger(__name__)


class DeltaRoute:
    """The delta side of `Client`: the route to a delta version, and the installed versions it may start from."""

    out_dir: Path
    board: SourceBoard
    sources: list[str]

    if TYPE_CHECKING:  # provided by Client
        async def _hedged_manifest(self, session: aiohttp.ClientSession, holders: list[str], version: int, *,
                                   run_id: str | None, min_version: int | None) -> SignedManifest | None: ...

        async def _pull_once(self, version: int | None, started: float, *, for_delta: bool = False) -> object: ...

    async def _base_for_delta(self, session: aiohttp.ClientSession, manifest: Manifest, holders: list[str],
                              for_delta: bool) -> tuple[bool, RelayError | None]:
        """Install the base of delta `manifest` if that is the way to get it. (False, None): the base is here, fetch
        the delta; (True, why): fetch the full weights instead, because the base chain cannot be had (`why`) or is
        dearer than the full weights and a holder offers them (None). Inside a base pull (`for_delta`) the base is
        pulled whatever it costs, and a failure raises: the outermost pull decides."""
        if self._held_base(manifest) is not None:
            return False, None
        if not for_delta:
            chain = await self._chain_bytes(session, manifest)
            if isinstance(chain, RelayError):
                log.warning("%s: fetching its full weights instead", chain)
                return True, chain
            if chain >= manifest.full_bytes and await self._offers_whole(session, manifest, holders):
                log.info("v%d: its base chain is %d bytes, its full weights %d: fetching the full weights",
                         manifest.version, chain, manifest.full_bytes)
                return True, None
        try:
            await self._hold_base(manifest)
        except RelayError as exc:
            if for_delta or isinstance(exc, StorageError):
                raise
            log.warning("v%d: its base chain cannot be had (%s): fetching its full weights instead",
                        manifest.version, exc)
            return True, exc
        return False, None

    async def _offers_whole(self, session: aiohttp.ClientSession, manifest: Manifest, holders: list[str]) -> bool:
        """Whether one of `holders` serves the full weights of delta `manifest` (a HEAD of its first full shard;
        relays answer 404, origins keep them): only then is a base chain dearer than them skipped."""
        if not manifest.weight_shards:
            return True

        async def one(url: str) -> bool:
            try:
                async with session.head(f"{url}/v/{manifest.version}/full/0",
                                        timeout=aiohttp.ClientTimeout(total=INDEX_TIMEOUT_S)) as response:
                    return response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        pending = {asyncio.ensure_future(one(url)) for url in holders}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(task.result() for task in done):
                    return True
        finally:
            for task in pending:
                task.cancel()
        return False

    async def _chain_bytes(self, session: aiohttp.ClientSession, manifest: Manifest) -> int | RelayError:
        """Bytes a pull of delta `manifest` through its base chain fetches: its own, and each base's down to one
        installed here or to the anchor (from their signed manifests); the reason when a base's manifest cannot be
        had from any source, or is not the base named (`DeltaBaseError`)."""
        total, ref = manifest.total_bytes, manifest.delta
        while ref is not None:
            if self._held(ref.base_version, ref.base_weights) is not None:
                return total
            signed = await self._hedged_manifest(session, self.board.order(self.sources), ref.base_version,
                                                 run_id=manifest.run_id, min_version=None)
            if signed is None:
                return RelayError(f"v{manifest.version}: no source serves the manifest of v{ref.base_version}, "
                                  f"in its base chain")
            if signed.manifest.weights_hash() != ref.base_weights:
                return DeltaBaseError(f"v{manifest.version}: its base chain names v{ref.base_version} with weights "
                                      f"{ref.base_weights[:12]}, the sources serve weights "
                                      f"{signed.manifest.weights_hash()[:12]}")
            total += signed.manifest.total_bytes
            ref = signed.manifest.delta
        return total

    def _other_manifest(self, manifest: Manifest) -> str | None:
        """How the installed copy of `manifest.version` came from another manifest than `manifest` (the one just
        resolved, signed: another run's, a trainer's that started over, a key that equivocated); None when it came
        from this one. Same file names and sizes do not make it this version."""
        try:
            held = self._installed_manifest(manifest.version)
        except StorageError as exc:
            return f"with an unreadable manifest ({exc})"
        if held.content_hash() != manifest.content_hash():
            return (f"from another manifest (0x{held.content_hash().hex()[:12]}; the sources sign "
                    f"0x{manifest.content_hash().hex()[:12]})")
        return None

    def _held_base(self, manifest: Manifest) -> Manifest | None:
        """The installed manifest of the delta's base when its full weights are here and are the ones named."""
        ref = manifest.delta
        assert ref is not None
        return self._held(ref.base_version, ref.base_weights)

    def _held(self, version: int, weights: str) -> Manifest | None:
        """The installed manifest of `version` when its full weights are here and have the weights hash `weights`."""
        directory = self.out_dir / f"v{version}"
        if not directory.is_dir() or not (self.out_dir / "manifests" / f"{version}.json").is_file():
            return None
        try:
            base = self._installed_manifest(version)
        except StorageError:
            return None
        if base.weights_hash() != weights or missing_files(directory, base):
            return None
        return base

    async def _hold_base(self, manifest: Manifest) -> None:
        """Make sure the base of delta `manifest` is installed: pull it (an anchor, or a delta whose own base is
        pulled first) when it is not. A base that cannot be had stops this pull with the reason."""
        ref = manifest.delta
        assert ref is not None
        if self._held_base(manifest) is not None:
            return
        log.info("v%d is a delta against v%d, which is not here: pulling v%d first", manifest.version,
                 ref.base_version, ref.base_version)
        await self._pull_once(ref.base_version, time.monotonic(), for_delta=True)
        if self._held_base(manifest) is None:
            raise DeltaBaseError(f"v{manifest.version} is a delta against v{ref.base_version} (weights "
                                 f"{ref.base_weights[:12]}), and the v{ref.base_version} the relays serve is not it")

    def _reconstruct(self, manifest: Manifest, staging: Path) -> Path:
        """Apply the verified delta in `staging` to the installed base; the directory of the full weights, each
        shard checked against the signed table (`DeltaMismatchError`, the staged delta dropped, otherwise)."""
        ref = manifest.delta
        assert ref is not None
        base = self._held_base(manifest)
        if base is None:  # retention removed it while the delta arrived
            raise DeltaBaseError(f"v{manifest.version}: its base v{ref.base_version} went away during the pull")
        full = self.out_dir / ".partial" / f"{manifest.version}.full"
        shutil.rmtree(full, ignore_errors=True)
        try:
            apply_delta(self.out_dir / f"v{ref.base_version}", base, staging, manifest, full)
        except (DeltaError, OSError) as exc:
            shutil.rmtree(full, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise StorageError(f"applying the delta of v{manifest.version}: {exc}") from exc
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return full

    def _installed_manifest(self, version: int) -> Manifest:
        path = self.out_dir / "manifests" / f"{version}.json"
        try:
            return SignedManifest.parse(path.read_bytes()).manifest
        except (OSError, ManifestError) as exc:
            raise StorageError(f"v{version} is installed but {path} cannot be read: {exc}") from exc
