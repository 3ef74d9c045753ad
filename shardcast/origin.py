"""The origin: the trainer's end of the tree, serving the versions it publishes.

Run it in the trainer's process (`Origin.publish()` returns the version number at once and shards,
hashes and signs on a background thread) or as its own process (`prime-relay origin`) over a store
directory that `prime-relay publish` writes into; it notices new versions on disk within
`watch_interval_s` and wakes long-polling relays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from protocol.errors import RelayError
from protocol.identity import Identity
from shardcast.errors import PublishError
from shardcast.manifest import SignedManifest
from shardcast.publisher import DEFAULT_SHARD_SIZE, Publisher
from shardcast.server import ServeLimits, ShardServer
from shardcast.store import Store

log = logging.getLogger(__name__)


class Origin:
    """Store + HTTP server + (with an identity) a non-blocking publisher."""

    def __init__(
        self,
        store_root: str | Path,
        *,
        run_id: str,
        identity: Identity | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        retention: int = 3,
        shard_size: int = DEFAULT_SHARD_SIZE,
        watch_interval_s: float = 0.5,
        limits: ServeLimits | None = None,
    ) -> None:
        self.store = Store(Path(store_root), retention=retention)
        self.store.run_id = run_id
        self.run_id = run_id
        self.identity = identity
        self.shard_size = shard_size
        self.server = ShardServer(self.store, role="origin", host=host, port=port, limits=limits)
        self.watch_interval_s = watch_interval_s
        self._publisher: Publisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.store.scan()
        await self.server.start()
        self._watcher = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.server.stop()
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.close)
            self._publisher = None

    async def __aenter__(self) -> Origin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval_s)
            self._scan()

    def publish(self, source: str | Path, version: int | None = None) -> int:
        """Queue `source` (file or directory) as the next version; returns its number immediately."""
        if self.identity is None:
            raise PublishError("this origin has no signing key")
        if self._publisher is None:
            self._publisher = Publisher(
                self.store.versions_dir, identity=self.identity, run_id=self.run_id, shard_size=self.shard_size,
                on_published=self._published,
            )
        return self._publisher.publish(source, version)

    def _published(self, version: int) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._scan)

    def _scan(self) -> None:
        try:
            self.store.scan()
        except RelayError as exc:  # e.g. the store's directory was removed: say so, keep serving
            log.error("cannot scan the store: %s", exc)

    async def wait_published(self, version: int) -> SignedManifest:
        """Wait until `version` is sharded, signed and being served."""
        if self._publisher is None:
            raise PublishError("nothing was published here")
        signed = await self._publisher.wait_async(version)
        while self.store.get(version) is None and version > (self.store.latest or -1):
            self.store.scan()
            await asyncio.sleep(0.01)
        return signed
