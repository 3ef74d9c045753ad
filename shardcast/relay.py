"""A relay: follows upstreams (the origin or other relays), verifies, re-serves while still fetching.

The follower long-polls every upstream's version index; when one announces a newer version it fetches
that manifest, checks the trainer's signature, run id and that the version is newer than anything
held, then advertises it at once and fetches the shards (several at a time, from the fastest
upstream). Each shard is served downstream the moment its hash checks (pipelining), so a tree of
relays streams rather than store-and-forwards. A newer version pre-empts an older one still
arriving. Unreachable upstreams are retried with capped exponential backoff forever: a relay
outlives restarts of everything above it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from pathlib import Path

import aiohttp

from protocol.errors import RelayError
from protocol.identity import checksum
from shardcast.errors import ManifestError
from shardcast.manifest import Manifest, ShardEntry, SignedManifest
from shardcast.server import ShardServer
from shardcast.sources import SourceBoard
from shardcast.store import Store, VersionState
from shardcast.transfer import Downloader, fetch_index, fetch_manifest, new_session
from shardcast.wire import parse_source

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.25
_BACKOFF_MAX_S = 10.0


class _ShardFiles:
    """`ShardSink` writing one file per shard, renamed into place (and announced) once verified."""

    def __init__(self, relay: Relay, state: VersionState) -> None:
        self.relay = relay
        self.state = state
        self._paths: dict[int, Path] = {}

    def open(self, shard: ShardEntry) -> tuple[int, int]:
        path = self.state.shard_path(shard.index).with_name(f"{shard.index}.part-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._paths[fd] = path
        return fd, 0

    def commit(self, shard: ShardEntry, fd: int) -> None:
        os.close(fd)
        os.rename(self._paths.pop(fd), self.state.shard_path(shard.index))
        self.relay.store.mark_available(self.state.version, shard.index)
        self.relay.server.metrics.shards_fetched.inc()

    def discard(self, shard: ShardEntry, fd: int) -> None:
        os.close(fd)
        with contextlib.suppress(OSError):
            self._paths.pop(fd).unlink()
        self.relay.server.metrics.bad_shards.inc()


class Relay:
    """Follower + store + HTTP server."""

    def __init__(
        self,
        upstreams: list[str],
        *,
        trainer: str,
        store_root: str | Path,
        run_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        retention: int = 3,
        concurrency: int = 4,
        poll_wait_s: float = 30.0,
    ) -> None:
        if not upstreams:
            raise RelayError("a relay needs at least one upstream")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        for url in self.upstreams:
            parse_source(url)  # SourceError now, not at the first shard
        self.trainer = checksum(trainer)
        self.run_id = run_id
        self.store = Store(Path(store_root), retention=retention, check=self._check)
        self.server = ShardServer(self.store, role="relay", host=host, port=port)
        self.concurrency = concurrency
        self.poll_wait_s = poll_wait_s
        self._follower: asyncio.Task[None] | None = None
        self._download: asyncio.Task[None] | None = None
        self._downloading: int | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def _check(self, signed: SignedManifest) -> Manifest:
        return signed.verify(self.trainer, run_id=self.run_id or self.store.run_id)

    async def start(self) -> None:
        self.store.scan()
        await self.server.start()
        self._follower = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        for task in (self._follower, self._download):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.server.stop()

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- following ----------------------------------------------------------------------------------

    async def _follow(self) -> None:
        async with new_session() as session:
            latest = self.store.latest
            if latest is not None and not self.store.get(latest).complete:  # type: ignore[union-attr]
                self._start_download(session, self.store.get(latest))  # type: ignore[arg-type]
            backoff = _BACKOFF_START_S
            while True:
                known = self.store.latest if self.store.latest is not None else -1
                newest = await self._poll(session, known)
                if newest is None:
                    await asyncio.sleep(backoff)
                    backoff = min(_BACKOFF_MAX_S, backoff * 2)
                    continue
                if newest > known and not await self._take(session, newest):
                    # Refused or unreachable everywhere: back off instead of re-asking at once (a
                    # forged or foreign manifest upstream must not turn into a busy loop).
                    await asyncio.sleep(backoff)
                    backoff = min(_BACKOFF_MAX_S, backoff * 2)
                    continue
                backoff = _BACKOFF_START_S

    async def _poll(self, session: aiohttp.ClientSession, known: int) -> int | None:
        """Long-poll all upstreams; the newest version announced, or None if every upstream failed."""
        tasks = [asyncio.create_task(fetch_index(session, u, after=known, wait=self.poll_wait_s)) for u in self.upstreams]
        best: int | None = None
        failed = 0
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    index = await next_done
                except RelayError as exc:
                    log.debug("upstream poll failed: %s", exc)
                    self.server.metrics.upstream_errors.inc()
                    failed += 1
                    continue
                best = max(best if best is not None else -1, index.latest if index.latest is not None else -1)
                if best > known:
                    break  # one upstream has news: no need to wait for the others' long-polls
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed == len(tasks):
            return None
        return best

    async def _take(self, session: aiohttp.ClientSession, version: int) -> bool:
        """Fetch and verify the manifest of `version`, advertise it, and start fetching its shards."""
        for url in self.upstreams:
            try:
                signed = await fetch_manifest(session, url, version)
                latest = self.store.latest
                signed.verify(self.trainer, run_id=self.run_id or self.store.run_id, version=version,
                              min_version=latest + 1 if latest is not None else None)
            except ManifestError as exc:
                log.warning("refusing manifest v%d from %s: %s", version, url, exc)
                continue
            except RelayError as exc:
                log.info("manifest v%d from %s: %s", version, url, exc)
                self.server.metrics.upstream_errors.inc()
                continue
            state = self.store.add(signed)
            log.info("following v%d (%d shards, %d bytes)", version, len(signed.manifest.shards),
                     signed.manifest.total_bytes)
            self._start_download(session, state)
            return True
        return False

    def _start_download(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        if self._download is not None and not self._download.done():
            log.info("v%d pre-empts v%s still arriving", state.version, self._downloading)
            self._download.cancel()
        self._downloading = state.version
        self._download = asyncio.create_task(self._fetch_version(session, state))

    async def _fetch_version(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        backoff = _BACKOFF_START_S
        while True:
            todo = [s.index for s in state.manifest.shards if s.index not in state.available]
            if not todo or self.store.get(state.version) is None:
                log.info("v%d complete", state.version)
                return
            downloader = Downloader(SourceBoard(self.upstreams), state.manifest, _ShardFiles(self, state),
                                    concurrency=self.concurrency)
            try:
                await downloader.run(todo)
            except RelayError as exc:
                # Bounded retries per attempt; the relay itself keeps trying (upstreams come back).
                log.warning("v%d: %s; retrying in %.1f s", state.version, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)
