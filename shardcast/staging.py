"""A pull's staging directory (`.partial/<N>/` of a client's `out_dir`, shardcast/client.py): the version's files
written in place at shard offsets, and the client's bookkeeping beside them under dot-names no manifest can use
(the signed manifest being pulled, the journal of verified shards); and the checks of an installed copy's files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import blake3

from shardcast.errors import StorageError
from shardcast.manifest import Manifest, ShardEntry, SignedManifest

STAGED_MANIFEST = ".manifest.json"
"""The signed manifest of a pull in progress, in `.partial/<N>/` (a dot-name: never a checkpoint file)."""
JOURNAL = ".journal"
"""Indices of the verified shards of a pull in progress, in `.partial/<N>/`."""
LEGACY_STAGED_MANIFEST = "manifest.json"  # where clients before the dot-names kept STAGED_MANIFEST


class StagedVersion:
    """The files of a version being pulled, written in place; implements `ShardSink`. `table`: whose files and shards
    are laid out (the signed manifest's own by default; a delta's `full_view()` when its full weights are fetched)."""

    def __init__(self, directory: Path, signed: SignedManifest, table: Manifest | None = None) -> None:
        self.directory = directory
        self.manifest = table if table is not None else signed.manifest
        self._fds: list[int] = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / STAGED_MANIFEST).write_bytes(signed.to_bytes())
        except OSError as exc:
            raise StorageError(f"cannot stage v{self.manifest.version} in {directory}: {exc.strerror or exc}") from exc
        for entry in self.manifest.files:
            path = directory / entry.path
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self.close()
                raise StorageError(f"cannot create {entry.path} in {directory}: {exc.strerror or exc}") from exc
            self._fds.append(fd)
            try:
                if os.fstat(fd).st_size != entry.size:
                    os.ftruncate(fd, entry.size)
            except OSError as exc:  # e.g. EFBIG: larger than this file system allows
                self.close()
                raise StorageError(f"cannot hold {entry.path} ({entry.size} bytes) in {directory}: "
                                   f"{exc.strerror or exc}") from exc
        self._journal = open(directory / JOURNAL, "a")  # noqa: SIM115 (closed in close())

    def check_space(self, todo: list[int]) -> None:
        """`StorageError` naming the first file that cannot fit if the file system lacks room for `todo`.

        Files are sparse until written, so what they still need is their size less what is already
        allocated to them (journaled shards and the bytes of an interrupted attempt).
        """
        if not todo:
            return
        try:
            stat = os.statvfs(self.directory)
        except OSError as exc:
            raise StorageError(f"cannot inspect {self.directory}: {exc.strerror or exc}") from exc
        free = stat.f_bavail * stat.f_frsize
        needed = 0
        for entry, fd in zip(self.manifest.files, self._fds, strict=True):
            needed += max(0, entry.size - os.fstat(fd).st_blocks * 512)
            if needed > free:
                raise StorageError(
                    f"no room for {entry.path} of v{self.manifest.version} ({entry.size} bytes) in "
                    f"{self.directory}: {needed} bytes needed up to this file, {free} free"
                )

    def verified_on_disk(self) -> set[int]:
        """Shards listed in the journal whose bytes still hash right (a crash may have lost writes)."""
        try:
            listed = {int(line) for line in (self.directory / JOURNAL).read_text().split() if line.isdigit()}
        except OSError:
            return set()
        good = set()
        for index in listed:
            if index < len(self.manifest.shards) and self._hash_matches(self.manifest.shards[index]):
                good.add(index)
        return good

    def _hash_matches(self, shard: ShardEntry) -> bool:
        hasher = blake3.blake3()
        fd = self._fds[shard.file]
        pos = 0
        while pos < shard.size:
            chunk = os.pread(fd, min(8 << 20, shard.size - pos), shard.offset + pos)
            if not chunk:
                return False
            hasher.update(chunk)
            pos += len(chunk)
        return hasher.hexdigest() == shard.hash

    def open(self, shard: ShardEntry) -> tuple[int, int]:
        return self._fds[shard.file], shard.offset

    def commit(self, shard: ShardEntry, fd: int) -> None:
        self._journal.write(f"{shard.index}\n")
        self._journal.flush()

    def discard(self, shard: ShardEntry, fd: int) -> None:
        """Nothing to undo: unjournaled bytes are simply overwritten by the next attempt."""

    def close(self, *, fsync: bool = False) -> None:
        try:
            for fd in self._fds:
                if fsync:
                    os.fsync(fd)
                os.close(fd)
        except OSError as exc:
            raise StorageError(f"writing v{self.manifest.version} in {self.directory}: {exc.strerror or exc}") from exc
        finally:
            self._fds = []
            if hasattr(self, "_journal"):
                self._journal.close()


def missing_files(directory: Path, manifest: Manifest) -> list[str]:
    """Files of `manifest` absent from `directory` or of the wrong size (an install damaged since, or made
    by a client that kept its bookkeeping under a checkpoint's own file name)."""
    missing = []
    for entry in manifest.weight_files:
        try:
            if (directory / entry.path).stat().st_size != entry.size:
                missing.append(entry.path)
        except OSError:
            missing.append(entry.path)
    return missing


def drop_if_nothing_verified(staging: Path) -> None:
    """Remove a staged pull that holds no verified shard (after a failure: nothing is worth keeping, and
    its files, sparse or not, may be huge)."""
    try:
        journaled = (staging / JOURNAL).read_text().split()
    except OSError:
        journaled = []
    if not journaled:
        shutil.rmtree(staging, ignore_errors=True)


def drop_stale_staging(staging: Path, signed: SignedManifest) -> None:
    """Start `staging` over if it holds a pull of another manifest for this version.

    A pull staged by a client before the dot-named bookkeeping keeps the manifest as `manifest.json`:
    kept (journal and all) when it is this manifest and the checkpoint has no file of that name,
    else started over, since the checkpoint's own `manifest.json` was then overwritten.
    """
    current, legacy = staging / STAGED_MANIFEST, staging / LEGACY_STAGED_MANIFEST
    try:
        if current.exists():
            if current.read_bytes() != signed.to_bytes():
                shutil.rmtree(staging)
        elif legacy.exists():
            declared = any(f.path == LEGACY_STAGED_MANIFEST for f in signed.manifest.files)
            if declared or legacy.read_bytes() != signed.to_bytes():
                shutil.rmtree(staging)
            else:
                legacy.unlink()
    except OSError as exc:
        raise StorageError(f"cannot clear {staging}: {exc.strerror or exc}") from exc
