"""Cutting a checkpoint into hashed shards and signing its manifest (the origin's half of SHARDCAST).

`Publisher.publish()` only allocates the version number and queues the work: sharding, hashing and
signing run on one background thread (in order, so versions appear in the order they were
published), and the caller's training step goes on. The checkpoint path must stay unchanged until
`wait(version)` returns (trainers write each step to a fresh directory, so this costs nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from protocol.identity import Identity
from shardcast.errors import PublishError
from shardcast.manifest import (
    DeltaRef,
    FileEntry,
    Manifest,
    ShardEntry,
    SignedManifest,
    now_ms,
    sign_manifest,
    valid_file_name,
)
from shardcast.store import FULL_DIR

log = logging.getLogger(__name__)

DEFAULT_SHARD_SIZE = 32 * 1024 * 1024
_COPY_CHUNK = 8 * 1024 * 1024


@contextlib.contextmanager
def _disk(what: str) -> Iterator[None]:
    """The file system's refusals (unreadable checkpoint, full or read-only store) as a `PublishError`."""
    try:
        yield
    except OSError as exc:
        raise PublishError(f"{what}: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}") from exc


def checkpoint_files(source: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of every regular file to publish, in a stable order."""
    source = Path(source)
    if source.is_file():
        pairs = [(source.name, source)]
    elif source.is_dir():
        pairs = []
        with _disk(f"cannot list {source}"):
            paths = sorted(source.rglob("*"))
        for path in paths:
            if path.is_symlink():
                raise PublishError(f"refusing to publish symlink {path}")
            if path.is_file():
                pairs.append((path.relative_to(source).as_posix(), path))
    else:
        raise PublishError(f"nothing to publish at {source}")
    for name, _ in pairs:
        if not valid_file_name(name):
            raise PublishError(f"file name {name!r} is not allowed in a manifest (charset [A-Za-z0-9._-], no leading dot)")
    if not pairs:
        raise PublishError(f"{source} holds no files")
    return pairs


def highest_version_on_disk(versions_dir: Path) -> int:
    """The highest version (finished or in progress) under `versions_dir`, or -1 when there is none."""
    highest = -1
    with _disk(f"cannot list {versions_dir}"):
        entries = list(os.scandir(versions_dir))
    for entry in entries:
        name = entry.name.removeprefix(".tmp-").split("-")[0]
        if name.isdigit():
            highest = max(highest, int(name))
    return highest


def next_version_on_disk(versions_dir: Path) -> int:
    """One more than the highest version (finished or in progress) under `versions_dir`, or 1."""
    return max(1, highest_version_on_disk(versions_dir) + 1)


@dataclass(frozen=True)
class DeltaBase:
    """The version a new one may be published as a delta against: its full files and its signed manifest."""

    directory: Path
    manifest: Manifest


def weights_table(source: Path, shard_size: int) -> tuple[tuple[FileEntry, ...], tuple[ShardEntry, ...]]:
    """The file and shard table (BLAKE3 per shard) of `source` as an anchor would list it, without copying."""
    files: list[FileEntry] = []
    shards: list[ShardEntry] = []
    for file_index, (name, path) in enumerate(checkpoint_files(source)):
        data = path.read_bytes()
        files.append(FileEntry(path=name, size=len(data)))
        for offset in range(0, len(data), shard_size):  # as `_shard_into` cuts it: an empty file has no shard
            chunk = data[offset:offset + shard_size]
            shards.append(ShardEntry(index=len(shards), file=file_index, offset=offset, size=len(chunk),
                                     hash=blake3.blake3(chunk).hexdigest()))
    return tuple(files), tuple(shards)


def build_version(
    source: Path,
    versions_dir: Path,
    *,
    identity: Identity,
    run_id: str,
    version: int,
    shard_size: int = DEFAULT_SHARD_SIZE,
    dtype: str | None = None,
    base: DeltaBase | None = None,
) -> SignedManifest:
    """Copy `source` into `versions_dir/<version>/shards/`, hashing each shard, and sign the manifest.

    With `base`, the version is published as a delta against it (`shardcast.delta`) when the delta is
    smaller than the full weights; otherwise, and without `base`, as an anchor (the full weights)."""
    final = versions_dir / str(version)
    if final.exists():
        raise PublishError(f"version {version} already exists")
    tmp = versions_dir / f".tmp-{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # an attempt of this process that died without cleaning up
    files: list[FileEntry] = []
    shards: list[ShardEntry] = []
    delta_src = versions_dir / f".delta-{version}-{os.getpid()}"
    try:
        ref: DeltaRef | None = None
        with _disk(f"publishing {source} as version {version}"):
            if base is not None and Path(source).is_dir():
                # The full weights are cut first (the table the delta must reproduce is hashed from this copy);
                # a delta version keeps them under `full/` (served at /v/N/full/i for a client whose base chain
                # is withheld), an anchor's become its shards.
                _shard_into(source, tmp, files, shards, shard_size, into=FULL_DIR)
                ref = _delta_into(Path(source), base, delta_src, tuple(files), tuple(shards))
                if ref is None:
                    os.rename(tmp / FULL_DIR, tmp / "shards")
                else:
                    files, shards = [], []
                    _shard_into(delta_src, tmp, files, shards, shard_size)
            else:
                _shard_into(source, tmp, files, shards, shard_size)
        manifest = Manifest(
            run_id=run_id,
            version=version,
            created_at_ms=now_ms(),
            shard_size=shard_size,
            files=tuple(files),
            shards=tuple(shards),
            dtype=dtype,
            delta=ref,
        )
        signed = sign_manifest(identity, manifest)
        with _disk(f"storing version {version} in {versions_dir}"):
            (tmp / "manifest.json").write_bytes(signed.to_bytes())
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(delta_src, ignore_errors=True)
    log.info("published version %d as %s: %d files, %d shards, %d bytes (full weights %d bytes)", version,
             f"a delta against v{ref.base_version}" if ref is not None else "an anchor", len(files), len(shards),
             manifest.total_bytes, manifest.full_bytes)
    return signed


def _delta_into(source: Path, base: DeltaBase, out: Path, full_files: tuple[FileEntry, ...],
                full_shards: tuple[ShardEntry, ...]) -> DeltaRef | None:
    """Write the delta from `base` to `source` (whose full table is `full_files`/`full_shards`) into `out`; its
    `DeltaRef`, or None when it would not be smaller than the full weights (then the version goes out as an
    anchor)."""
    from shardcast.delta import make_delta

    shutil.rmtree(out, ignore_errors=True)
    stats = make_delta(base.directory, source, out, [f.path for f in full_files])
    if stats.delta_bytes >= stats.full_bytes:
        log.info("v%d: a delta would be %d of %d bytes: publishing an anchor", base.manifest.version + 1,
                 stats.delta_bytes, stats.full_bytes)
        return None
    return DeltaRef(base_version=base.manifest.version, base_weights=base.manifest.weights_hash(),
                    files=full_files, shards=full_shards)


def _shard_into(source: Path, tmp: Path, files: list[FileEntry], shards: list[ShardEntry], shard_size: int,
                into: str = "shards") -> None:
    """Copy the files of `source` into `tmp/<into>/<i>`, hashing each shard; fill `files` and `shards`."""
    (tmp / into).mkdir(parents=True)
    for file_index, (name, path) in enumerate(checkpoint_files(source)):
        with open(path, "rb") as src:
            size = os.fstat(src.fileno()).st_size
            files.append(FileEntry(path=name, size=size))
            offset = 0
            while offset < size:
                length = min(shard_size, size - offset)
                shard_path = tmp / into / str(len(shards))
                _copy_range(src.fileno(), shard_path, offset, length)
                # Hash the copy, not the source: what is signed is exactly what will be served.
                hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
                hasher.update_mmap(shard_path)
                shards.append(
                    ShardEntry(index=len(shards), file=file_index, offset=offset, size=length, hash=hasher.hexdigest())
                )
                offset += length


def _copy_range(src_fd: int, dest: Path, offset: int, length: int) -> None:
    """Copy `length` bytes at `offset` of `src_fd` into a new file `dest`, in the kernel where possible
    (copy_file_range: no round trip through Python buffers; a reflink on filesystems that share extents)."""
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < length:
            try:
                n = os.copy_file_range(src_fd, out, length - done, offset + done)
            except OSError:  # e.g. a filesystem without it: fall back to read/write
                n = len(chunk := os.pread(src_fd, min(_COPY_CHUNK, length - done), offset + done))
                os.write(out, chunk)
            if n == 0:
                raise PublishError(f"source shrank while being published ({offset + done} of {offset + length} bytes)")
            done += n
    finally:
        os.close(out)


def publish_blocking(
    source: Path, store_root: Path, *, identity: Identity, run_id: str, version: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE, dtype: str | None = None, base: DeltaBase | None = None,
) -> SignedManifest:
    """Publish from another process than the origin server (the CLI): a file lock orders versions."""
    versions_dir = Path(store_root) / "versions"
    with _disk(f"cannot open the store {store_root}"):
        versions_dir.mkdir(parents=True, exist_ok=True)
        lock = open(Path(store_root) / ".publish.lock", "w")  # noqa: SIM115 (closed by the with below)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        chosen = next_version_on_disk(versions_dir)
        if version is not None:
            # an explicit version may be 0 (a trainer's starting weights) while the store is empty
            highest = highest_version_on_disk(versions_dir)
            if version <= highest:
                raise PublishError(f"version {version} is not newer than what the store holds ({highest})")
            chosen = version
        return build_version(source, versions_dir, identity=identity, run_id=run_id, version=chosen,
                             shard_size=shard_size, dtype=dtype, base=base)


class Publisher:
    """Non-blocking publishing into a store served by this process's origin."""

    def __init__(
        self,
        versions_dir: Path,
        *,
        identity: Identity,
        run_id: str,
        shard_size: int = DEFAULT_SHARD_SIZE,
        on_published: Callable[[int], None] | None = None,
    ) -> None:
        self.versions_dir = versions_dir
        self.identity = identity
        self.run_id = run_id
        self.shard_size = shard_size
        self._on_published = on_published
        self._lock = threading.Lock()
        self._next = next_version_on_disk(versions_dir)
        self._futures: dict[int, Future[SignedManifest]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardcast-publish")

    def publish(self, source: str | Path, version: int | None = None) -> int:
        """Queue `source` (a file or directory) as a new version and return its number at once."""
        source = Path(source)
        if not source.exists():
            raise PublishError(f"nothing to publish at {source}")
        with self._lock:
            if version is None:
                version = self._next
            elif version < self._next:
                raise PublishError(f"version {version} is not newer than {self._next - 1}")
            self._next = version + 1
            future = self._executor.submit(
                build_version, source, self.versions_dir, identity=self.identity, run_id=self.run_id,
                version=version, shard_size=self.shard_size,
            )
            self._futures[version] = future
        chosen: int = version
        future.add_done_callback(lambda f: self._done(chosen, f))
        return version

    def _done(self, version: int, future: Future[SignedManifest]) -> None:
        if future.exception() is not None:
            log.error("publishing version %d failed: %s", version, future.exception())
            return
        if self._on_published is not None:
            self._on_published(version)

    def wait(self, version: int, timeout: float | None = None) -> SignedManifest:
        """Block until `version` is published (re-raising its `PublishError`)."""
        return self._futures[version].result(timeout)

    async def wait_async(self, version: int) -> SignedManifest:
        return await asyncio.wrap_future(self._futures[version])

    def close(self) -> None:
        self._executor.shutdown(wait=True)
