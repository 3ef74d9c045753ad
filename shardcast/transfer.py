"""Fetching from relays: the version index, manifests, and shards (in parallel, verified, resumable).

Used by the client (writing into the files of a staged version) and by relays (writing one file per
shard that downstream requests may already be waiting for). Shards stream to disk chunk by chunk
while being hashed, so memory per transfer stays at the socket buffer size whatever the shard size.
A transfer cut short resumes with an HTTP Range request, preferably from another relay; when the
hash then fails nobody can be blamed, so the shard is fetched again whole from one source, and a
source that alone served bad bytes is banned.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import blake3
from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import RelayError
from shardcast.errors import (
    ManifestError,
    ManifestTooLargeError,
    ShardHashError,
    SourceError,
    SourceTimeoutError,
    StorageError,
)
from shardcast.manifest import MAX_MANIFEST_BYTES, Manifest, ShardEntry, SignedManifest
from shardcast.sources import SourceBoard, SourceStats
from shardcast.wire import ConnectionPool

log = logging.getLogger(__name__)

READ_BUFFER = 4 * 1024 * 1024
# Shard bodies are received into one buffer of this size per worker, then written and hashed while
# the bytes are still in cache (L2 holds it). Measured on 2 cores (bench/shardcast.py): 4 MiB batches
# cost more CPU than 512 KiB ones.
ABSORB_BATCH = 512 * 1024
MAX_INDEX_BYTES = 1024 * 1024
INDEX_TIMEOUT_S = 15.0
"""A version index (beyond a long-poll's own wait) that has not come in this long: the relay is hung."""
MANIFEST_TIMEOUT_S = 60.0
"""A manifest that has not come in this long: the relay is hung."""


def new_session(*, limit_per_host: int = 32) -> aiohttp.ClientSession:
    """A client session tuned for bulk transfers (large read buffer, no total timeout)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256, limit_per_host=limit_per_host),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10, sock_read=90),
        read_bufsize=READ_BUFFER,
        auto_decompress=False,
    )


class VersionInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int
    complete: bool
    shards: int
    bytes: int


class VersionIndex(BaseModel):
    """The answer of `/versions` (unsigned: it only says where to look; manifests carry the trust)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str | None
    latest: int | None
    versions: list[VersionInfo]


async def _read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes:
    if response.content_length is not None and response.content_length > limit:
        raise ManifestTooLargeError(f"{response.url} announced {response.content_length} bytes, limit {limit}")
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise ManifestTooLargeError(f"{response.url} sent more than {limit} bytes")
    return bytes(data)


async def fetch_index(
    session: aiohttp.ClientSession, url: str, *, after: int | None = None, wait: float = 0.0
) -> VersionIndex:
    """The version index of `url`; with `wait`, a long-poll for a version newer than `after`."""
    params = {"after": str(after if after is not None else -1), "wait": str(wait)}
    try:
        async with session.get(
            f"{url.rstrip('/')}/versions", params=params,
            timeout=aiohttp.ClientTimeout(total=wait + INDEX_TIMEOUT_S, sock_read=wait + INDEX_TIMEOUT_S),
        ) as response:
            if response.status != 200:
                raise SourceError(f"{url}/versions answered {response.status}")
            data = await _read_limited(response, MAX_INDEX_BYTES)
    except TimeoutError as exc:
        raise SourceTimeoutError(f"{url}/versions: no answer in {wait + INDEX_TIMEOUT_S:g} s") from exc
    except aiohttp.ClientError as exc:
        raise SourceError(f"{url}/versions: {exc.__class__.__name__}: {exc}") from exc
    try:
        return VersionIndex.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"{url}/versions: malformed index") from exc


async def fetch_manifest(
    session: aiohttp.ClientSession, url: str, version: int, *, max_bytes: int = MAX_MANIFEST_BYTES,
    timeout: float = MANIFEST_TIMEOUT_S,
) -> SignedManifest:
    """The signed manifest of `version` from `url`, parsed (not yet verified)."""
    try:
        async with session.get(f"{url.rstrip('/')}/v/{version}/manifest", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status == 404:
                raise SourceError(f"{url} does not hold version {version}")
            if response.status != 200:
                raise SourceError(f"{url}/v/{version}/manifest answered {response.status}")
            data = await _read_limited(response, max_bytes)
    except TimeoutError as exc:
        raise SourceTimeoutError(f"{url}/v/{version}/manifest: no answer in {timeout:g} s") from exc
    except aiohttp.ClientError as exc:
        raise SourceError(f"{url}: {exc.__class__.__name__}: {exc}") from exc
    return SignedManifest.parse(data, max_bytes=max_bytes)


async def verified_manifest(
    session: aiohttp.ClientSession, board: SourceBoard, url: str, version: int, *, trainer: str,
    run_id: str | None, min_version: int | None, timeout: float = MANIFEST_TIMEOUT_S,
) -> SignedManifest | None:
    """`version`'s manifest from `url` if it verifies, else None; a source serving one that does not is banned.

    The one fetch-verify-ban step of both a pulling client and a relay. A manifest that fails
    verification (malformed, not signed by `trainer`, another run, another version than asked for,
    older than `min_version`) is the source's doing, never bad luck: ban. A source that cannot produce a
    manifest (404, timeout, refused) is only failed (cooled down): retention or a restart can drop a
    version between the index and this request.
    """
    source = board.sources[url]
    try:
        signed = await fetch_manifest(session, url, version, timeout=timeout)
        signed.verify(trainer, run_id=run_id, version=version, min_version=min_version)
    except ManifestError as exc:
        log.warning("banning %s: %s", url, exc)
        board.ban(source, f"manifest: {exc}")
        return None
    except SourceError as exc:
        log.info("%s: %s", url, exc)
        board.failure(source, timed_out=isinstance(exc, SourceTimeoutError))
        return None
    board.answered(source)
    source.versions += 1
    return signed


class ShardSink(Protocol):
    """Where verified shard bytes go."""

    def open(self, shard: ShardEntry) -> tuple[int, int]:
        """A file descriptor and the file offset at which the shard's first byte goes."""

    def commit(self, shard: ShardEntry, fd: int) -> None:
        """The shard's bytes are complete and match the manifest."""

    def discard(self, shard: ShardEntry, fd: int) -> None:
        """The partial bytes are useless (hash mismatch or giving up)."""


@dataclass
class _Partial:
    fd: int
    base: int
    pos: int = 0
    hasher: blake3.blake3 = field(default_factory=blake3.blake3)
    contributors: set[str] = field(default_factory=set)


def _absorb(partial: _Partial, data: memoryview) -> None:
    """Write `data` (the shard's next bytes) at the partial's position and feed it to the shard's hash."""
    offset = partial.base + partial.pos
    view = data
    while view:  # a short write to a regular file is rare (full disk: the next call raises) but legal
        written = os.pwrite(partial.fd, view, offset)
        if written == 0:
            raise OSError(errno.ENOSPC, f"pwrite wrote nothing at offset {offset}")
        offset += written
        view = view[written:]
    partial.hasher.update(data)
    partial.pos += len(data)


class _Unavailable(Exception):
    """The source does not (yet) hold the shard: 404/503, not the source's fault."""


@dataclass
class TransferStats:
    shards_fetched: int = 0
    bytes_fetched: int = 0
    range_resumes: int = 0
    hash_failures: int = 0


class Downloader:
    """Fetches a set of shards of one version from the sources on `board` into `sink`."""

    def __init__(
        self,
        board: SourceBoard,
        manifest: Manifest,
        sink: ShardSink,
        *,
        concurrency: int = 8,
        max_failures_per_shard: int = 8,
        unavailable_timeout_s: float = 180.0,
        min_rate: float = 16 * 1024,
        min_rate_grace_s: float = 20.0,
        on_bytes: Callable[[int], None] | None = None,
        on_shard: Callable[[ShardEntry], None] | None = None,
        route: str = "shards",
        read_timeout: float = 90.0,
    ) -> None:
        self.board = board
        self.manifest = manifest
        """Whose `shards` are fetched (for a delta's full weights: the table `delta.shards`, as `full_view` gives it)."""
        self.route = route
        """The URL segment shards are asked at: `shards` (`/v/N/shards/i`), or `full` for a delta's full weights."""
        self.read_timeout = read_timeout
        """Seconds of silence (no response head, no body byte) after which a source is failed over as hung."""
        self.sink = sink
        self.concurrency = concurrency
        self.max_failures_per_shard = max_failures_per_shard
        self.unavailable_timeout_s = unavailable_timeout_s
        self.min_rate = min_rate
        """Bytes/s below which a shard transfer is given up (after `min_rate_grace_s`) and resumed elsewhere:
        a source dripping a byte now and then would otherwise hold a worker for as long as it likes."""
        self.min_rate_grace_s = min_rate_grace_s
        self.on_bytes = on_bytes
        self.on_shard = on_shard
        self.stats = TransferStats()

    async def run(self, indices: list[int]) -> None:
        """Fetch and verify every shard in `indices`; `RelayError` if one cannot be had."""
        queue = deque(indices)
        pool = ConnectionPool(read_timeout=self.read_timeout)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self.concurrency, len(queue))):
                    group.create_task(self._worker(queue, pool))
        except BaseExceptionGroup as group:
            # Callers get the typed error of the first shard that failed, not a group.
            raise group.exceptions[0] from None
        finally:
            pool.close()

    async def _worker(self, queue: deque[int], pool: ConnectionPool) -> None:
        buffer = memoryview(bytearray(ABSORB_BATCH))  # reused for every shard this worker fetches
        while queue:
            shard = self.manifest.shards[queue.popleft()]
            try:
                await self._fetch(shard, pool, buffer)
            except OSError as exc:  # network errors are SourceErrors by now: this is the local disk
                name = self.manifest.files[shard.file].path
                raise StorageError(f"writing {name} (shard {shard.index} of v{self.manifest.version}): "
                                   f"{exc.strerror or exc}") from exc

    async def _fetch(self, shard: ShardEntry, pool: ConnectionPool, buffer: memoryview) -> None:
        failed: set[str] = set()
        failures = 0
        unavailable_since: float | None = None
        partial: _Partial | None = None
        try:
            while True:
                pick = self.board.pick(exclude=failed)
                if isinstance(pick, float):
                    await asyncio.sleep(pick)
                    continue
                source = pick
                if partial is None:
                    fd, base = self.sink.open(shard)
                    partial = _Partial(fd=fd, base=base)
                source.inflight += 1
                started = time.monotonic()
                start_pos = partial.pos
                try:
                    await self._attempt(source, shard, partial, pool, buffer)
                except _Unavailable:
                    self.board.failure(source, soft=True)
                    failed.add(source.url)
                    unavailable_since = unavailable_since or time.monotonic()
                    if time.monotonic() - unavailable_since > self.unavailable_timeout_s:
                        raise RelayError(
                            f"shard {shard.index} of v{self.manifest.version} unavailable everywhere for "
                            f"{self.unavailable_timeout_s:.0f} s"
                        ) from None
                    continue
                except ShardHashError as exc:
                    self.stats.hash_failures += 1
                    if partial.contributors == {source.url}:
                        log.warning("banning %s: %s", source.url, exc)
                        self.board.ban(source, str(exc))
                    self.sink.discard(shard, partial.fd)
                    partial = None
                    continue
                except SourceError as exc:
                    log.info("shard %d from %s failed: %s", shard.index, source.url, exc)
                    self.board.failure(source, timed_out=isinstance(exc, SourceTimeoutError))
                    failed.add(source.url)
                    failures += 1
                    if failures >= self.max_failures_per_shard:
                        raise RelayError(f"shard {shard.index} failed {failures} times; last: {exc}") from exc
                    continue
                finally:
                    source.inflight -= 1
                self.board.success(source, shard.size - start_pos, time.monotonic() - started)
                self.sink.commit(shard, partial.fd)
                partial = None
                self.stats.shards_fetched += 1
                if self.on_shard is not None:
                    self.on_shard(shard)
                return
        except BaseException:
            if partial is not None:
                self.sink.discard(shard, partial.fd)
            raise

    async def _attempt(
        self, source: SourceStats, shard: ShardEntry, partial: _Partial, pool: ConnectionPool, buffer: memoryview
    ) -> None:
        path = f"/v/{self.manifest.version}/{self.route}/{shard.index}"
        url = source.url + path
        resuming = partial.pos > 0
        headers = {"Range": f"bytes={partial.pos}-"} if resuming else {}
        if resuming:
            self.stats.range_resumes += 1
        conn, response = await pool.request(source.url, path, headers)
        try:
            if response.status in (404, 503):
                raise _Unavailable()
            if response.status != (206 if resuming else 200):
                raise SourceError(f"{url} answered {response.status}")
            remaining = shard.size - partial.pos
            if response.content_length is None:
                raise SourceError(f"{url} sent no Content-Length")
            partial.contributors.add(source.url)
            if response.content_length != remaining:
                raise ShardHashError(f"{url} announced {response.content_length} bytes, expected {remaining}")
            # Writing (to the page cache) and hashing (blake3, ~5 GB/s) run inline on the event loop:
            # both are far faster than the network, and handing them to a worker thread cost more CPU in
            # GIL hand-overs and wake-ups than the work itself. `partial.pos` counts bytes written; when
            # the stream breaks, what the buffer holds is written too, so a resume continues after it.
            prefix = response.prefix[:remaining]
            filled = len(prefix)
            buffer[:filled] = prefix
            received = filled
            body_started = time.monotonic()
            self._count(filled)
            try:
                while received < remaining:
                    if filled == len(buffer):
                        _absorb(partial, buffer[:filled])
                        filled = 0
                        await asyncio.sleep(0)  # data may be waiting on every recv: let other tasks run
                    n = await conn.recv_into(buffer[filled : filled + min(len(buffer) - filled, remaining - received)])
                    if n == 0:
                        raise SourceError(f"{url} ended after {partial.pos + filled} of {shard.size} bytes")
                    filled += n
                    received += n
                    elapsed = time.monotonic() - body_started
                    if elapsed > self.min_rate_grace_s and received < self.min_rate * elapsed:
                        raise SourceError(f"{url}: {received / elapsed:.0f} B/s over {elapsed:.1f} s, below the "
                                          f"{self.min_rate:.0f} B/s floor")
                    self._count(n)
            finally:
                if filled:
                    _absorb(partial, buffer[:filled])
            conn.reusable = response.keep_alive and len(response.prefix) <= remaining
        finally:
            pool.release(conn)
        digest = partial.hasher.hexdigest()
        if digest != shard.hash:
            raise ShardHashError(f"shard {shard.index} of v{self.manifest.version}: hash {digest[:16]}… != {shard.hash[:16]}…")

    def _count(self, n: int) -> None:
        self.stats.bytes_fetched += n
        if self.on_bytes is not None and n:
            self.on_bytes(n)
