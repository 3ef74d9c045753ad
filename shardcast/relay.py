"""A relay: follows upstreams (the origin or other relays), verifies, re-serves while still fetching.

Each upstream has a watcher that long-polls its version index. When an upstream announces a version
newer than anything held, its watcher fetches that manifest from it and checks it exactly as a
pulling client does (`transfer.verified_manifest`: the trainer's signature, the run id, the version
asked for, newer than anything held). A manifest that fails bans the upstream (remembered in
`<store>/bans.json` for `ban_s`, as a client's bans are, and across retries and versions); one it
cannot produce (404, timeout) only fails it. The version is advertised at once and its shards are
fetched (several at a time, from the best-scored upstreams). Each shard is served downstream the
moment its hash checks (pipelining), so a tree of relays streams rather than store-and-forwards. A
newer version pre-empts an older one still arriving.

Watchers are independent so that no upstream can hold up another: one that announces a version it
cannot back (999999, then 404), or hangs its manifest, occupies only its own watcher, and an honest
upstream's new version is taken as soon as it is announced. An upstream that answers the long-poll
at once without anything usable (a server that ignores `wait`) is polled no more often than a capped
exponential backoff allows instead of in a busy loop. Unreachable upstreams are retried the same way
forever: a relay outlives restarts of everything above it.

The full weights of a delta version (`/v/N/full/i`, the fallback of a client whose base chain is withheld) are not
followed: a shard of them is fetched from the upstreams when a client first asks for it, checked like any shard,
and kept beside the version (`_fetch_full`).

Upstreams learned from announcements (`add_upstream`) are bounded: one per announcing signer (its newest),
`MAX_LEARNED` in all, and a learned upstream that is dead (`DEAD_AFTER` failed polls in a row) or lying
(banned) gives its slot to the next one announced (`drop_upstream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

import aiohttp

from protocol.errors import RelayError
from protocol.identity import checksum
from shardcast.bans import DEFAULT_BAN_S, BanList
from shardcast.errors import ManifestError, RelayConfigError
from shardcast.manifest import Manifest, ShardEntry, SignedManifest
from shardcast.server import ServeLimits, ShardServer
from shardcast.sources import SourceBoard, SourceStats
from shardcast.store import FULL_DIR, Store, VersionState
from shardcast.transfer import Downloader, fetch_index, new_session, verified_manifest
from shardcast.wire import parse_source

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.25
_BACKOFF_MAX_S = 10.0
_BAN_RECHECK_MAX_S = 60.0
MAX_LEARNED = 16
"""Learned upstreams (from announcements) a relay follows at most, besides its configured ones."""
DEAD_AFTER = 3
FULL_UNAVAILABLE_S = 2.0
"""A delta version's full-weight shard no upstream holds this long (404 everywhere): answered 404 downstream."""
"""Failed index polls in a row after which a learned upstream counts as dead (its slot may be taken)."""


class _ShardFiles:
    """`ShardSink` writing one file per shard, renamed into place (and announced) once verified. `full`: shards of a
    delta version's full weights (`versions/<N>/full/<i>`, fetched on demand), not of the version itself."""

    def __init__(self, relay: Relay, state: VersionState, *, full: bool = False) -> None:
        self.relay = relay
        self.state = state
        self.full = full
        self._paths: dict[int, Path] = {}

    def _final(self, index: int) -> Path:
        return self.state.directory / FULL_DIR / str(index) if self.full else self.state.shard_path(index)

    def open(self, shard: ShardEntry) -> tuple[int, int]:
        final = self._final(shard.index)
        final.parent.mkdir(exist_ok=True)
        path = final.with_name(f"{shard.index}.part-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._paths[fd] = path
        return fd, 0

    def commit(self, shard: ShardEntry, fd: int) -> None:
        os.close(fd)
        os.rename(self._paths.pop(fd), self._final(shard.index))
        if not self.full:
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
        ban_s: float = DEFAULT_BAN_S,
        limits: ServeLimits | None = None,
    ) -> None:
        if not upstreams:
            raise RelayConfigError("a relay needs at least one upstream")
        self.upstreams = list(dict.fromkeys(u.rstrip("/") for u in upstreams))
        for url in self.upstreams:
            parse_source(url)  # SourceError now, not at the first shard
        self.trainer = checksum(trainer)
        self.run_id = run_id
        self.store = Store(Path(store_root), retention=retention, check=self._check)
        self.server = ShardServer(self.store, role="relay", host=host, port=port, limits=limits)
        self.concurrency = concurrency
        self.poll_wait_s = poll_wait_s
        self.board = SourceBoard(self.upstreams)
        """Scores, cool-downs and bans of the upstreams, kept across polls, versions and retries."""
        self.bans = BanList(Path(store_root) / "bans.json", duration_s=ban_s)
        """Upstreams banned by this relay (or an earlier run of it) stay banned for `ban_s` (0: this run only)."""
        self.bans.apply(self.board)
        self.announced: dict[str, int | None] = dict.fromkeys(self.upstreams)
        """The newest version each upstream announced at its last answer (None: unreachable, banned)."""
        self.polls: dict[str, int] = dict.fromkeys(self.upstreams, 0)
        """Index requests sent to each upstream."""
        self._follower: asyncio.Task[None] | None = None
        self._download: asyncio.Task[None] | None = None
        self._downloading: int | None = None
        self._watching: tuple[aiohttp.ClientSession, asyncio.TaskGroup] | None = None
        self.configured = len(self.upstreams)
        """How many upstreams came from the configuration (the rest were learned: `add_upstream`)."""
        self.learned: dict[str, str] = {}
        """Learned upstream URL -> the signer that announced it (oldest first)."""
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._full_fetches: dict[tuple[int, int], asyncio.Future[Path | None]] = {}
        self.server.fetch_full = self._fetch_full

    @property
    def url(self) -> str:
        return self.server.url

    def forget_bans(self) -> None:
        """Clear the remembered bans (and lift them on this relay)."""
        self.bans.forget()
        for source in self.board.sources.values():
            source.banned, source.ban_reason = False, None

    def add_upstream(self, url: str, *, signer: str | None = None, max_learned: int = MAX_LEARNED,
                     max_per_signer: int = 1) -> bool:
        """Follow one more upstream (learned, e.g. from a discovery announcement); call on the relay's event loop.

        The URL is untrusted: it is parsed like a configured one, never our own, never one still banned, and
        everything it serves is checked as from any upstream (signed manifest, shard hashes; bans). Learned
        upstreams are bounded so that announcements cannot take the relay over (issue 23 item 12):

        - at most `max_per_signer` per announcing `signer` (the discovery signer; None: the URL counts as its
          own signer): a signer's newer announcement replaces its older URL, it never adds to it;
        - at most `max_learned` in all; when full, a new one takes the slot of the unhealthiest learned
          upstream if there is one (banned for serving bad bytes, or `DEAD_AFTER` failed polls in a row),
          else it is refused: a healthy learned upstream keeps its slot, a dead or lying one frees it.

        Returns whether it was added."""
        url = url.rstrip("/")
        if url in self.upstreams or url == self.url:
            return False
        try:
            parse_source(url)
        except Exception as exc:  # noqa: BLE001 - an unusable learned URL is skipped, never fatal
            log.warning("not following learned upstream %r: %s", url[:120], exc)
            return False
        probe = SourceBoard([url])
        if self.bans.apply(probe):
            log.info("not following learned upstream %s: still banned", url)
            return False
        owner = signer or url
        theirs = [u for u, s in self.learned.items() if s == owner]
        if len(theirs) >= max_per_signer:
            self.drop_upstream(theirs[0], f"{owner} announced {url} since")
        elif len(self.learned) >= max_learned:
            worst = self._unhealthiest_learned()
            if worst is None:
                log.info("not following learned upstream %s: %d learned upstreams, all healthy", url, len(self.learned))
                return False
            self.drop_upstream(worst, f"unhealthy, its slot goes to {url}")
        self.upstreams.append(url)
        self.learned[url] = owner
        self.board.sources[url] = SourceStats(url)
        self.announced[url] = None
        self.polls[url] = 0
        if self._watching is not None:
            session, group = self._watching
            self._watchers[url] = group.create_task(self._watch(session, url))
        log.info("following learned upstream %s (announced by %s)", url, owner)
        return True

    def _unhealthiest_learned(self) -> str | None:
        """The learned upstream that most deserves to lose its slot: banned (it lied) first, then the one with
        the most failed polls in a row, if at least `DEAD_AFTER`; None when every learned upstream is healthy."""
        def badness(url: str) -> tuple[int, int]:
            source = self.board.sources[url]
            return int(source.banned), source.consecutive_failures

        worst = max(self.learned, key=badness, default=None)
        if worst is None:
            return None
        banned, failures = badness(worst)
        return worst if banned or failures >= DEAD_AFTER else None

    def drop_upstream(self, url: str, why: str) -> bool:
        """Stop following a learned upstream (configured ones stay); its bans are kept on disk."""
        if url not in self.learned:
            return False
        self.bans.record(self.board)  # a lying upstream stays banned after it leaves the board
        del self.learned[url]
        self.upstreams.remove(url)
        self.board.sources.pop(url, None)
        self.announced.pop(url, None)
        self.polls.pop(url, None)
        task = self._watchers.pop(url, None)
        if task is not None:
            task.cancel()
        log.info("no longer following learned upstream %s: %s", url, why)
        return True

    def _check(self, signed: SignedManifest) -> Manifest:
        return signed.verify(self.trainer, run_id=self.run_id or self.store.run_id)

    def _known(self) -> int:
        return self.store.latest if self.store.latest is not None else -1

    async def start(self) -> None:
        self.store.scan()
        await self.server.start()
        self._follower = asyncio.create_task(self._follow())
        self._follower.add_done_callback(_report_death)

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
            state = self.store.get(latest) if latest is not None else None
            if state is not None and not state.complete:
                self._start_download(session, state)
            async with asyncio.TaskGroup() as group:
                for url in self.upstreams:
                    self._watchers[url] = group.create_task(self._watch(session, url))
                self._watching = (session, group)

    async def _watch(self, session: aiohttp.ClientSession, url: str) -> None:
        """Follow one upstream's version index for as long as the relay runs."""
        source = self.board.sources[url]
        backoff = _BACKOFF_START_S
        while True:
            if source.banned:
                self.announced[url] = None
                self.bans.lift_expired(self.board)
                if source.banned:  # not asked anything, not even its index, until the ban runs out
                    until = self.bans.expires(url)
                    left = until - time.time() if until is not None else _BAN_RECHECK_MAX_S
                    await asyncio.sleep(min(_BAN_RECHECK_MAX_S, max(0.05, left)))
                    continue
            known = self._known()
            started = time.monotonic()
            self.polls[url] += 1
            try:
                index = await fetch_index(session, url, after=known, wait=self.poll_wait_s)
            except RelayError as exc:
                log.debug("upstream poll failed: %s", exc)
                self.server.metrics.upstream_errors.inc()
                self.board.failure(source)
                self.announced[url] = None
                await asyncio.sleep(backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)
                continue
            source.consecutive_failures = 0  # it answered: alive (bad bytes ban it instead)
            announced = self.announced[url] = index.latest
            if announced is not None and announced > known:
                await self._consider(session, url, announced, known)
                if self._known() >= announced:
                    backoff = _BACKOFF_START_S
                    continue  # its news is taken (from it or from another upstream): poll again at once
            # Nothing usable in this answer. An honest upstream answers only with news or at the end of
            # its long-poll window; one that answers sooner with nothing (or with a version it cannot
            # back) is asked again only after a backoff that grows while that goes on.
            elapsed = time.monotonic() - started
            if elapsed >= backoff:
                backoff = _BACKOFF_START_S
                continue
            await asyncio.sleep(backoff - elapsed)
            backoff = min(_BACKOFF_MAX_S, backoff * 2)

    async def _consider(self, session: aiohttp.ClientSession, url: str, version: int, known: int) -> None:
        """Verify the manifest of `version` that `url` announced; advertise it and fetch it if still newest."""
        signed = await verified_manifest(session, self.board, url, version, trainer=self.trainer,
                                         run_id=self.run_id or self.store.run_id, min_version=known + 1)
        if signed is not None and version > self._known():
            try:
                state = self.store.add(signed)
            except ManifestError as exc:  # another run than the one this relay holds, taken meanwhile
                log.warning("banning %s: %s", url, exc)
                self.board.ban(self.board.sources[url], f"manifest: {exc}")
            except RelayError as exc:
                log.error("cannot take v%d: %s", version, exc)
                self.server.metrics.upstream_errors.inc()
            else:
                log.info("following v%d (%d shards, %d bytes)", version, len(signed.manifest.shards),
                         signed.manifest.total_bytes)
                self._start_download(session, state)
        self.bans.record(self.board)

    def _start_download(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        if self._download is not None and not self._download.done():
            log.info("v%d pre-empts v%s still arriving", state.version, self._downloading)
            self._download.cancel()
        self._downloading = state.version
        self._download = asyncio.create_task(self._fetch_version(session, state))

    async def _fetch_version(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        await self._fetch_shards(session, state)
        await self._fetch_bases(session, state)

    async def _fetch_bases(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        """Hold the bases of a delta version down to its anchor (a client holding nothing rebuilds from them):
        each base's manifest must be the trainer's and carry the weights hash the delta names."""
        ref = state.manifest.delta
        while ref is not None:
            base_state = self.store.get(ref.base_version)
            if base_state is None:
                base: SignedManifest | None = None
                for url in self.upstreams:
                    if self.board.sources[url].banned:
                        continue
                    base = await verified_manifest(session, self.board, url, ref.base_version, trainer=self.trainer,
                                                   run_id=self.run_id or self.store.run_id, min_version=None)
                    if base is not None:
                        break
                if base is None:
                    log.warning("v%d is a delta against v%d, which no upstream serves: clients holding nothing "
                                "cannot rebuild it from here", state.version, ref.base_version)
                    return
                try:
                    base_state = self.store.add(base)
                except RelayError as exc:
                    log.error("cannot take v%d, the base of v%d: %s", ref.base_version, state.version, exc)
                    return
            if base_state.manifest.weights_hash() != ref.base_weights:
                log.warning("v%d is a delta against weights %s, and v%d here holds others: not following its bases",
                            state.version, ref.base_weights[:12], ref.base_version)
                return
            await self._fetch_shards(session, base_state)  # at once when it is complete (a version pre-empted is not)
            ref = base_state.manifest.delta

    async def _fetch_full(self, state: VersionState, index: int) -> Path | None:
        """Shard `index` of delta version `state`'s full weights, fetched from the upstreams when a client first asks
        (checked against the signed full-weight table; an upstream serving bad bytes is banned as for any shard);
        None when no upstream has it within `FULL_UNAVAILABLE_S`. Relays keep no full weights otherwise: a version's
        full copy crosses the tree only towards the clients that need it."""
        key = (state.version, index)
        if key not in self._full_fetches:
            self._full_fetches[key] = asyncio.ensure_future(self._fetch_full_once(state, index))
            self._full_fetches[key].add_done_callback(lambda _: self._full_fetches.pop(key, None))
        return await asyncio.shield(self._full_fetches[key])

    async def _fetch_full_once(self, state: VersionState, index: int) -> Path | None:
        path = state.full_path(index)
        if path is not None:
            return path
        downloader = Downloader(self.board, state.manifest.full_view(), _ShardFiles(self, state, full=True),
                                concurrency=1, route="full", unavailable_timeout_s=FULL_UNAVAILABLE_S)
        try:
            await downloader.run([index])
        except RelayError as exc:
            log.info("full weights of v%d, shard %d: %s", state.version, index, exc)
            return None
        except OSError as exc:  # the version was dropped by retention meanwhile, or the disk refused
            log.warning("full weights of v%d, shard %d: %s", state.version, index, exc)
            return None
        finally:
            self.bans.record(self.board)
        return state.full_path(index)

    async def _fetch_shards(self, session: aiohttp.ClientSession, state: VersionState) -> None:
        backoff = _BACKOFF_START_S
        while True:
            todo = [s.index for s in state.manifest.shards if s.index not in state.available]
            if not todo or self.store.get(state.version) is None:
                log.info("v%d complete", state.version)
                return
            downloader = Downloader(self.board, state.manifest, _ShardFiles(self, state), concurrency=self.concurrency)
            try:
                await downloader.run(todo)
            except RelayError as exc:
                # Bounded retries per attempt; the relay itself keeps trying (upstreams come back).
                log.warning("v%d: %s; retrying in %.1f s", state.version, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)
            finally:
                self.bans.record(self.board)  # an upstream that served bad shard bytes stays banned


def _report_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the relay stopped following its upstreams", exc_info=task.exception())
