"""The on-disk version store shared by origin and relays, and its in-memory index.

Layout under `root`:

    versions/<N>/manifest.json     the signed manifest, exactly as received/signed
    versions/<N>/shards/<index>    one file per verified shard (written as `.part-*`, renamed when verified)
    versions/<N>/full/<index>      origin only, for a delta version: the shards of the full weights it reproduces
                                   (`delta.shards`), for clients whose base chain no source serves
    versions/.tmp-*                versions being published (renamed to `<N>` when complete)

A shard file exists under its final name only after its hash matched the signed manifest, so a
restarted relay trusts what it finds (and finishes the rest). The in-memory index lives on the event
loop's thread; other threads hand results over with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import RelayError
from shardcast.errors import ManifestError, RelayConfigError, StorageError
from shardcast.manifest import Manifest, SignedManifest

log = logging.getLogger(__name__)

ManifestCheck = Callable[[SignedManifest], Manifest]
FULL_DIR = "full"
"""Where a delta version's full-weight shards live beside its own (`versions/<N>/full/<index>`)."""


@contextlib.contextmanager
def _disk(what: str) -> Iterator[None]:
    """The file system's refusals as a `StorageError` saying what was being done."""
    try:
        yield
    except OSError as exc:
        raise StorageError(f"{what}: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}") from exc


@dataclass
class VersionState:
    """One version held by this server: its manifest and which shards are verified on disk."""

    signed: SignedManifest
    raw: bytes
    directory: Path
    available: set[int] = field(default_factory=set)
    waiters: dict[int, asyncio.Event] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return self.signed.manifest.version

    @property
    def manifest(self) -> Manifest:
        return self.signed.manifest

    @property
    def complete(self) -> bool:
        return len(self.available) == len(self.manifest.shards)

    def shard_path(self, index: int) -> Path:
        return self.directory / "shards" / str(index)

    def full_path(self, index: int) -> Path | None:
        """Shard `index` of a delta version's full weights, when this store keeps them (the origin's does)."""
        if self.manifest.delta is None or index >= len(self.manifest.delta.shards):
            return None
        path = self.directory / FULL_DIR / str(index)
        return path if path.is_file() else None


class Store:
    """Versions on disk plus the events that long-polls and pipelined shard requests wait on."""

    def __init__(self, root: Path, *, retention: int = 3, check: ManifestCheck | None = None) -> None:
        if retention < 1:
            raise RelayConfigError(f"retention must be >= 1, not {retention}")
        self.root = Path(root)
        self.versions_dir = self.root / "versions"
        with _disk(f"cannot create the store {self.versions_dir}"):
            self.versions_dir.mkdir(parents=True, exist_ok=True)
        self.retention = retention
        self._check = check
        self._versions: dict[int, VersionState] = {}
        self._changed = asyncio.Event()
        self.run_id: str | None = None

    # -- reading -------------------------------------------------------------------------------

    def get(self, version: int) -> VersionState | None:
        return self._versions.get(version)

    def versions(self) -> list[int]:
        return sorted(self._versions)

    @property
    def latest(self) -> int | None:
        return max(self._versions) if self._versions else None

    def index(self) -> dict[str, object]:
        """The version index served at `/versions`."""
        return {
            "run_id": self.run_id,
            "latest": self.latest,
            "versions": [
                {"version": v, "complete": s.complete, "shards": len(s.manifest.shards), "bytes": s.manifest.total_bytes}
                for v, s in sorted(self._versions.items())
            ],
        }

    # -- changes ---------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return when the index changes (new version, shard completion of a version) or on timeout."""
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass

    def scan(self) -> list[int]:
        """Load versions that appeared on disk (published by another process); return the new ones."""
        found: list[int] = []
        vanished = [v for v, s in self._versions.items() if not s.directory.exists()]
        for version in vanished:  # removed by another process's retention
            self._versions.pop(version)
        with _disk(f"cannot list {self.versions_dir}"):
            entries = list(os.scandir(self.versions_dir))
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) in self._versions:
                continue
            directory = Path(entry.path)
            try:
                raw = (directory / "manifest.json").read_bytes()
                signed = SignedManifest.parse(raw)
                if self._check is not None:
                    self._check(signed)
            except (OSError, RelayError) as exc:
                log.warning("skipping version dir %s: %s", directory, exc)
                continue
            if signed.manifest.version != int(entry.name):
                log.warning("skipping %s: manifest says version %d", directory, signed.manifest.version)
                continue
            state = VersionState(signed=signed, raw=raw, directory=directory)
            shards_dir = directory / "shards"
            if shards_dir.is_dir():
                with _disk(f"cannot list {shards_dir}"):
                    shard_files = list(os.scandir(shards_dir))
                for shard_file in shard_files:
                    if shard_file.name.isdigit() and int(shard_file.name) < len(signed.manifest.shards):
                        state.available.add(int(shard_file.name))
            self._adopt(state)
            found.append(state.version)
        if found or vanished:
            self.gc()
            self._notify()
        return found

    def _adopt(self, state: VersionState) -> None:
        if self.run_id is None:
            self.run_id = state.manifest.run_id
        elif state.manifest.run_id != self.run_id:
            raise ManifestError(f"store holds run {self.run_id!r}, refusing a manifest of run {state.manifest.run_id!r}")
        self._versions[state.version] = state

    def add(self, signed: SignedManifest) -> VersionState:
        """Record a (verified) manifest whose shards will arrive later (relays)."""
        version = signed.manifest.version
        existing = self._versions.get(version)
        if existing is not None:
            return existing
        directory = self.versions_dir / str(version)
        raw = signed.to_bytes()
        with _disk(f"cannot store the manifest of v{version} in {directory}"):
            (directory / "shards").mkdir(parents=True, exist_ok=True)
            tmp = directory / "manifest.json.tmp"
            tmp.write_bytes(raw)
            os.replace(tmp, directory / "manifest.json")
        state = VersionState(signed=signed, raw=raw, directory=directory)
        self._adopt(state)
        self.gc()
        self._notify()
        return state

    def mark_available(self, version: int, index: int) -> None:
        state = self._versions.get(version)
        if state is None:
            return
        state.available.add(index)
        event = state.waiters.pop(index, None)
        if event is not None:
            event.set()
        if state.complete:
            self._notify()

    async def wait_shard(self, state: VersionState, index: int, timeout: float) -> bool:
        """Wait until shard `index` of `state` is verified on disk (pipelining); False on timeout."""
        if index in state.available:
            return True
        event = state.waiters.setdefault(index, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return index in state.available

    # -- retention -------------------------------------------------------------------------------

    def gc(self) -> list[int]:
        """Drop every version but the newest `retention` ones and the bases those need (memory and disk).

        A delta version is of no use without its base, so the chain of bases below a kept delta, down to
        its anchor, is kept too: a client that holds nothing can always rebuild what is served."""
        kept = set(sorted(self._versions)[-self.retention:])
        for version in sorted(kept, reverse=True):
            ref = self._versions[version].manifest.delta
            while ref is not None and ref.base_version in self._versions and ref.base_version not in kept:
                kept.add(ref.base_version)
                ref = self._versions[ref.base_version].manifest.delta
        doomed = sorted(v for v in self._versions if v not in kept)
        for version in doomed:
            state = self._versions.pop(version)
            for event in state.waiters.values():
                event.set()  # wake pipelined requests; they see the shard missing and answer 404
            # Open file handles keep serving in-flight responses after the unlink (POSIX semantics).
            shutil.rmtree(state.directory, ignore_errors=True)
            log.info("retention: removed version %d", version)
        with _disk(f"cannot list {self.versions_dir}"):
            entries = list(os.scandir(self.versions_dir))
        for entry in entries:
            # Leftovers of a publish that died half-way, and versions GC'd by another process.
            if entry.name.startswith((".tmp-", ".delta-")) and not _pid_alive(entry.name):
                shutil.rmtree(entry.path, ignore_errors=True)
        return doomed


def _pid_alive(tmp_name: str) -> bool:
    """`.tmp-<version>-<pid>` (and `.delta-...`) directories belong to a live publisher while that pid runs."""
    try:
        pid = int(tmp_name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
