"""The pulling side (nodes, validators, `prime-relay pull`): get a version, verified, swapped in atomically.

Layout of `out_dir`:

    current -> v<N>            symlink, replaced atomically (rename of a fresh link) after a pull
    v<N>/...                   the checkpoint's files, exactly as the trainer published them
    manifests/<N>.json         the signed manifest each installed version was checked against
    bans.json                  relays banned by earlier pulls (shardcast.bans)
    .partial/<N>/              a pull in progress: the files (written in place at shard offsets), and
                               this client's bookkeeping under dot-names no manifest can use (file names
                               never start with a dot): `.manifest.json` (the signed manifest being
                               pulled) and `.journal` (indices of verified shards)
    .partial/<N>.full/         a delta being applied to its base (the full files it produces)
    .partial/<N>.whole/        a delta version's full weights being fetched instead (as `.partial/<N>/`)

The bookkeeping stays out of the checkpoint's namespace: a checkpoint may itself contain a
`manifest.json` (clients before this layout kept theirs under that name, and lost the checkpoint's).
A pull killed half-way resumes from `.partial/<N>/`: shards in the journal are re-hashed locally (cheap)
and kept, the rest are fetched. Replay guard: a `latest` pull never moves `current` backwards and
refuses manifests of another run; a pull of an explicit version must get a manifest of that version.

Beside this module: `shardcast/staging.py` (a pull's staging directory and its bookkeeping) and
`shardcast/delta_route.py` (how a delta version is had: its base chain or its full weights, the delta applied).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from protocol.errors import RelayError
from protocol.identity import checksum
from shardcast.bans import DEFAULT_BAN_S, BanList
from shardcast.delta_route import DeltaRoute
from shardcast.errors import (
    DeltaBaseError,
    ManifestError,
    RelayConfigError,
    SourceTimeoutError,
    StorageError,
)
from shardcast.manifest import Manifest, SignedManifest
from shardcast.sources import SourceBoard
from shardcast.staging import (
    JOURNAL,
    STAGED_MANIFEST,
    StagedVersion,
    drop_if_nothing_verified,
    drop_stale_staging,
    missing_files,
)
from shardcast.transfer import (
    MANIFEST_TIMEOUT_S,
    Downloader,
    TransferStats,
    fetch_index,
    new_session,
    verified_manifest,
)
from shardcast.wire import parse_source

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_FOLLOW_BACKOFF_START_S = 0.5
_FOLLOW_BACKOFF_MAX_S = 30.0
HEDGE_S = 1.0
"""A manifest request unanswered this long: the next relay holding the version is asked beside it."""
INDEX_GRACE_S = 2.0
"""Once one source has given its version index, how long the others are waited for (at least)."""
PROBE_S = 30.0
"""How often a pull asks a hung source for its index again (it is skipped in between)."""
"""Once one source has given its version index, how long the others are waited for (at least)."""


@dataclass
class PullResult:
    """What a pull did."""

    version: int
    path: Path
    manifest: Manifest
    fetched_shards: int
    reused_shards: int
    bytes_fetched: int
    seconds: float
    sources: dict[str, dict[str, object]] = field(default_factory=dict)
    range_resumes: int = 0
    """Transfers cut short and continued with a Range request."""
    hash_failures: int = 0
    """Shards whose bytes did not match the manifest (their sole source is banned)."""
    served: dict[str, int] = field(default_factory=dict)
    """Shards of this version each source served in this pull that matched the signed manifest's hashes (sources that
    served none are absent): which relays actually delivered the version, whatever they announce."""
    whole: bool = False
    """A delta version fetched as its full weights (its base chain was withheld, or dearer than them)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "path": str(self.path), "fetched_shards": self.fetched_shards,
            "reused_shards": self.reused_shards, "bytes_fetched": self.bytes_fetched,
            "seconds": round(self.seconds, 3), "sources": self.sources,
            "range_resumes": self.range_resumes, "hash_failures": self.hash_failures, "served": self.served,
            "whole": self.whole,
        }


@dataclass
class _Fetched:
    """What one download into a staging directory did."""

    staging: Path
    stats: TransferStats
    reused: int
    served: dict[str, int]


class Client(DeltaRoute):
    """Pulls checkpoint versions of one run from a set of relays."""

    def __init__(
        self,
        sources: list[str],
        *,
        trainer: str,
        out_dir: str | Path,
        run_id: str | None = None,
        concurrency: int = 8,
        keep: int = 2,
        progress: bool | None = None,
        fsync: bool = False,
        wait_s: float = 0.0,
        ban_s: float = DEFAULT_BAN_S,
        stall_s: float = 5.0,
        read_timeout_s: float = 90.0,
        unavailable_s: float = 180.0,
        manifest_timeout_s: float = MANIFEST_TIMEOUT_S,
    ) -> None:
        if not sources:
            raise RelayConfigError("at least one source URL is needed")
        self.sources = [s.rstrip("/") for s in sources]
        for url in self.sources:
            parse_source(url)  # SourceError now, not at the first shard
        self.trainer = checksum(trainer)
        self.out_dir = Path(out_dir)
        self.run_id = run_id
        self.concurrency = concurrency
        self.keep = max(1, keep)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.fsync = fsync
        self.wait_s = wait_s
        self.board = SourceBoard(self.sources)
        self.bans = BanList(self.out_dir / "bans.json", duration_s=ban_s)
        """Relays banned by earlier pulls are skipped (`ban_s`: how long a ban lasts; 0: not remembered)."""
        self.bans.apply(self.board)
        self.stall_s = stall_s
        """A `latest` pull whose download made no progress this long switches to a newer signed version."""
        self.read_timeout_s = read_timeout_s
        """A source silent this long in a shard transfer (no response head, no byte) is failed over as hung."""
        self.unavailable_s = unavailable_s
        self.manifest_timeout_s = manifest_timeout_s
        """A manifest request unanswered this long fails (the source is marked hung)."""
        """A shard no source holds (404/503 everywhere) for this long fails the download (a delta's then falls
        back to the version's full weights)."""
        self.on_shard: Any = None  # test/observer hook: called with each verified ShardEntry
        self._unbacked: dict[str, int] = {}
        """Per source, the newest version it announced that no source could back with a manifest that
        verifies (at the last resolution): waiting for news, that source wakes us only for a newer one."""

    # -- local state -------------------------------------------------------------------------------

    def installed_version(self) -> int | None:
        """The version `current` points at, or None."""
        link = self.out_dir / "current"
        try:
            target = os.readlink(link)
        except OSError:
            return None
        name = Path(target).name
        return int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None

    def _installed_run_id(self) -> str | None:
        version = self.installed_version()
        if version is None:
            return None
        try:
            return SignedManifest.parse((self.out_dir / "manifests" / f"{version}.json").read_bytes()).manifest.run_id
        except (OSError, ManifestError):
            return None

    # -- finding a version -------------------------------------------------------------------------

    async def latest_available(self, session: aiohttp.ClientSession) -> dict[str, int | None]:
        """Each source's newest version (None where unreachable, banned, hung or too slow).

        Every source not banned is asked at once. Once one has given a version, the others get
        `INDEX_GRACE_S` (or 4x the first answer's time, if longer): a live source that has not answered by
        then is counted as timed out (hung), so a relay that accepts and stays silent costs one pull
        seconds, not the index timeout. A hung source is asked again at most every `PROBE_S` (and always
        by `wait_for_version`'s long-poll): a probe that answers within the same grace clears it; one that
        does not is dropped, not counted again.
        """
        board = self.board

        async def one(url: str) -> int | None:
            try:
                latest = (await fetch_index(session, url)).latest
            except RelayError as exc:
                log.info("index of %s: %s", url, exc)
                board.failure(board.sources[url], timed_out=isinstance(exc, SourceTimeoutError))
                return None
            board.answered(board.sources[url])
            return latest

        now = time.monotonic()
        asked = [u for u, src in ((u, board.sources[u]) for u in self.sources)
                 if not src.banned and (not src.hung or now - src.probed_at >= PROBE_S)]  # banned: never asked again
        for u in asked:
            board.sources[u].probed_at = now
        tasks = {u: asyncio.ensure_future(one(u)) for u in asked}
        waited = {tasks[s.url] for s in board.live() if s.url in tasks}
        started, first = time.monotonic(), None
        pending = set(tasks.values())
        try:
            while pending:
                grace = None if first is None else max(INDEX_GRACE_S, 4 * (first - started)) - (time.monotonic() - first)
                if grace is not None and grace <= 0:
                    break
                done, pending = await asyncio.wait(pending, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
                if first is None and any(t.result() is not None for t in done):
                    first = time.monotonic()
        finally:
            for url, task in tasks.items():
                if not task.done():
                    task.cancel()
                    if task in waited:  # a live source that let the others answer first by far: hung
                        board.failure(board.sources[url], timed_out=True)
                        log.info("index of %s: no answer %.1f s after the first source's", url,
                                 time.monotonic() - (first or started))
        return {u: (tasks[u].result() if u in tasks and tasks[u].done() and not tasks[u].cancelled() else None)
                for u in self.sources}

    async def wait_for_version(self, after: int, timeout: float) -> int | None:
        """Long-poll every source until one advertises a version newer than `after` (None on timeout).

        A source that announced a version nobody could back (see `_unbacked`) counts only when it
        announces something newer than that: a relay claiming version 999999 forever cannot wake us.
        """
        floors = {u: max(after, self._unbacked.get(u, -1)) for u in self.sources if not self.board.sources[u].banned}
        async with new_session() as session:
            tasks = {asyncio.ensure_future(fetch_index(session, u, after=floor, wait=timeout)): u
                     for u, floor in floors.items()}
            pending = set(tasks)
            deadline = time.monotonic() + timeout + 1
            try:
                while pending and time.monotonic() < deadline:
                    done, pending = await asyncio.wait(pending, timeout=deadline - time.monotonic(),
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task.exception() is None:
                            self.board.answered(self.board.sources[tasks[task]])
                            if (task.result().latest or -1) > floors[tasks[task]]:
                                return task.result().latest
            finally:
                for task in pending:
                    task.cancel()
        return None

    async def follow(self, *, poll_s: float = 60.0) -> AsyncIterator[PullResult]:
        """Install the newest version, then every newer one as soon as a source advertises it.

        Yields the result of each install (a version already installed is not yielded again). Behind by
        several versions, it jumps to the newest; it never goes backwards. Errors (no source reachable,
        every source banned, a pull that failed) are logged and retried with backoff; it runs until
        cancelled. `poll_s`: the long-poll window on the sources' version index.
        """
        backoff = _FOLLOW_BACKOFF_START_S
        woken = False
        wasted = _FOLLOW_BACKOFF_START_S
        while True:
            before = self.installed_version()
            try:
                result = await self.pull()
            except RelayError as exc:
                log.warning("follow: %s; retrying within %.1f s", exc, backoff)
                await self._pause(before if before is not None else -1, backoff)
                backoff = min(_FOLLOW_BACKOFF_MAX_S, backoff * 2)
                continue
            backoff = _FOLLOW_BACKOFF_START_S
            if result.version != before:
                yield result
                wasted = _FOLLOW_BACKOFF_START_S
            elif woken:
                # A source announced a newer version, and nothing newer could be verified: whatever it
                # announces next, do not pull again at once (a source can invent versions forever).
                await asyncio.sleep(wasted)
                wasted = min(_FOLLOW_BACKOFF_MAX_S, wasted * 2)
            woken = await self._pause(result.version, poll_s)

    async def _pause(self, after: int, seconds: float) -> bool:
        """Wait up to `seconds`, returning as soon as a source advertises a version newer than `after`
        (True) or once the time is up (False).

        If every source answers at once without one (unreachable, or banned), sleep out the rest of
        `seconds` rather than ask again straight away.
        """
        started = time.monotonic()
        if await self.wait_for_version(after, seconds) is None:
            await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))
            return False
        return True

    async def _verified_manifest(self, session: aiohttp.ClientSession, url: str, version: int, *,
                                 run_id: str | None, min_version: int | None) -> SignedManifest | None:
        """`version`'s manifest from `url` if it verifies; a source serving one that does not is banned."""
        return await verified_manifest(session, self.board, url, version, trainer=self.trainer, run_id=run_id,
                                       min_version=min_version, timeout=self.manifest_timeout_s)

    async def _resolve(self, session: aiohttp.ClientSession, version: int | None) -> tuple[SignedManifest, list[str]]:
        """A verified manifest for `version` (None: the newest anyone has) and the sources holding it."""
        run_id = self.run_id or self._installed_run_id()
        installed = self.installed_version()
        deadline = time.monotonic() + self.wait_s
        while True:
            latest = await self.latest_available(session)
            if version is None:
                candidates = sorted({v for v in latest.values() if v is not None}, reverse=True)
            else:
                candidates = [version]
            for candidate in candidates:
                if version is None and installed is not None and candidate < installed:
                    break  # never go backwards on `latest`
                holders = self.board.order([u for u, v in latest.items() if v is not None and v >= candidate])
                signed = await self._hedged_manifest(session, holders, candidate, run_id=run_id,
                                                     min_version=installed if version is None else None)
                if signed is not None:
                    if version is None:
                        self._note_unbacked(latest, candidate)
                    return signed, holders
            if time.monotonic() >= deadline:
                if version is None and installed is not None:
                    self._note_unbacked(latest, installed)
                    raise _NothingNewer(installed)
                what = f"version {version}" if version is not None else "any version"
                raise RelayError(f"no source holds a verifiable {what}: {self.board.summary()}")
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    async def _hedged_manifest(self, session: aiohttp.ClientSession, holders: list[str], version: int, *,
                               run_id: str | None, min_version: int | None) -> SignedManifest | None:
        """`version`'s verified manifest from the first of `holders` (best first) to give one: the next holder
        is asked too when the ones asked so far have all failed, or `HEDGE_S` after the last was asked (a
        slow or hung relay does not hold the pull); the first manifest that verifies wins, the rest are
        cancelled. None when no holder gave one."""
        queue = list(holders)
        running: set[asyncio.Task[SignedManifest | None]] = set()
        try:
            while queue or running:
                if queue and not running:
                    running.add(asyncio.ensure_future(self._verified_manifest(
                        session, queue.pop(0), version, run_id=run_id, min_version=min_version)))
                done, running = await asyncio.wait(running, timeout=HEDGE_S if queue else None,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.result() is not None:
                        return task.result()
                if not done and queue:  # the hedge: the next holder, beside the slow one
                    running.add(asyncio.ensure_future(self._verified_manifest(
                        session, queue.pop(0), version, run_id=run_id, min_version=min_version)))
        finally:
            for task in running:
                task.cancel()
        return None

    def _note_unbacked(self, latest: dict[str, int | None], resolved: int) -> None:
        """Remember, per source, an announced version newer than the newest one that could be verified."""
        for url, announced in latest.items():
            if announced is not None and announced > resolved:
                self._unbacked[url] = announced
            else:
                self._unbacked.pop(url, None)

    # -- pulling -----------------------------------------------------------------------------------

    async def pull(self, version: int | None = None) -> PullResult:
        """Download `version` (None: the newest available), verify it, and install it."""
        self.bans.lift_expired(self.board)  # a long `follow` outlives the bans it started with
        try:
            return await self._pull(version)
        finally:
            self.bans.record(self.board)  # relays banned during this pull stay banned for the next ones

    def forget_bans(self) -> None:
        """Clear the remembered bans (and lift them on this client)."""
        self.bans.forget()
        for source in self.board.sources.values():
            source.banned, source.ban_reason = False, None

    async def _pull(self, version: int | None) -> PullResult:
        started = time.monotonic()
        while True:
            try:
                return await self._pull_once(version, started)
            except _Superseded as exc:
                log.info("v%d stopped arriving and v%d is out: pulling v%d instead", exc.old, exc.new, exc.new)

    async def _pull_once(self, version: int | None, started: float, *, for_delta: bool = False) -> PullResult:
        """One pull of `version`. A delta version comes as its delta when its base is here or its base chain is
        cheaper than its full weights and can be had; otherwise (base chain dearer, or withheld: a manifest,
        shard or delta of it that no source gives) as its full weights (`/v/N/full/i`, checked against the signed
        full-weight table). `for_delta`: this pull fetches the base of a delta, whose own pull falls back if it
        fails, so it does not fall back itself."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {self.out_dir}: {exc.strerror or exc}") from exc
        async with new_session() as session:
            try:
                signed, holders = await self._resolve(session, version)
            except _NothingNewer as exc:
                manifest = self._installed_manifest(exc.version)
                return PullResult(exc.version, self.out_dir / f"v{exc.version}", manifest, 0, len(manifest.shards), 0,
                                  time.monotonic() - started, self.board.summary())
            manifest = signed.manifest
            final = self.out_dir / f"v{manifest.version}"
            if final.is_dir() and (self.out_dir / "manifests" / f"{manifest.version}.json").exists():
                other = self._other_manifest(manifest)
                if other is not None and for_delta:
                    # the base of a delta: the version held stays (a validator checks work against it); the delta
                    # is then not for this base, and its pull takes the full weights instead
                    raise DeltaBaseError(f"v{manifest.version} is installed {other}; it is kept")
                missing = missing_files(final, manifest)
                if other is None and not missing:
                    self._install_guarded(lambda: self._swap(manifest.version), manifest.version)
                    return PullResult(manifest.version, final, manifest, 0, len(manifest.shards), 0,
                                      time.monotonic() - started, self.board.summary())
                log.warning("v%d is installed %s: pulling it again", manifest.version,
                            other or f"without {', '.join(missing[:5])}")
            chain_failure: RelayError | None = None
            whole = False
            if manifest.delta is not None:
                whole, chain_failure = await self._base_for_delta(session, manifest, holders, for_delta)
            fetched: _Fetched | None = None
            if not whole:
                try:
                    fetched = await self._fetch(session, signed, manifest, holders, version)
                    if manifest.delta is not None:
                        fetched.staging = await asyncio.to_thread(self._reconstruct, manifest, fetched.staging)
                except RelayError as exc:
                    if manifest.delta is None or for_delta or isinstance(exc, StorageError):
                        raise
                    log.warning("v%d: its delta cannot be had or applied (%s): fetching its full weights instead",
                                manifest.version, exc)
                    whole, chain_failure = True, exc
            if whole:
                try:
                    fetched = await self._fetch(session, signed, manifest.full_view(), holders, version, route="full")
                except RelayError as exc:
                    if chain_failure is None or isinstance(exc, StorageError):
                        raise
                    # neither way: the error says why the chain failed (a wrong base stays a DeltaBaseError)
                    raise type(chain_failure)(f"{chain_failure}; and its full weights: {exc}") from exc
        assert fetched is not None
        self._install_guarded(lambda: self._install(signed, fetched.staging), manifest.version)
        seconds = time.monotonic() - started
        log.info("installed v%d in %.2f s (%d shards fetched, %d reused%s)", manifest.version, seconds,
                 fetched.stats.shards_fetched, fetched.reused, ", as its full weights" if whole else "")
        stats = fetched.stats
        return PullResult(manifest.version, final, manifest, stats.shards_fetched, fetched.reused, stats.bytes_fetched,
                          seconds, self.board.summary(), stats.range_resumes, stats.hash_failures, fetched.served,
                          whole=whole)

    async def _fetch(self, session: aiohttp.ClientSession, signed: SignedManifest, table: Manifest, holders: list[str],
                     version: int | None, *, route: str = "shards") -> _Fetched:
        """Download the shards of `table` (the signed manifest's own, or its `full_view()` at `route` `full`) from
        `holders` into a staging directory, resuming what an earlier attempt verified there."""
        manifest = signed.manifest
        staging = self.out_dir / ".partial" / (str(manifest.version) + ("" if route == "shards" else ".whole"))
        drop_stale_staging(staging, signed)
        try:
            staged = StagedVersion(staging, signed, table)
        except StorageError:
            drop_if_nothing_verified(staging)
            raise
        try:
            done = staged.verified_on_disk()
            todo = [s.index for s in table.shards if s.index not in done]
            try:
                staged.check_space(todo)
            except StorageError:
                staged.close()
                drop_if_nothing_verified(staging)
                raise
            board = SourceBoard(holders)
            for url in holders:  # carry scores and bans over from manifest resolution
                board.sources[url] = self.board.sources[url]
            ok_before = {url: board.sources[url].ok for url in holders}
            bar = self._progress_bar(table, todo)
            downloader = Downloader(
                board, table, staged, concurrency=self.concurrency, route=route, read_timeout=self.read_timeout_s,
                unavailable_timeout_s=self.unavailable_s, on_bytes=bar.update if bar is not None else None,
                on_shard=self.on_shard,
            )
            log.info("pulling v%d%s: %d shards (%d already verified) from %d source(s)", manifest.version,
                     "" if route == "shards" else f" ({route} weights)", len(todo), len(done), len(holders))
            try:
                if version is None:  # "latest": a version the relays gave up on must not hold us
                    await self._download_unless_superseded(session, downloader, todo, manifest)
                else:
                    await downloader.run(todo)
            finally:
                if bar is not None:
                    bar.close()
        finally:
            staged.close(fsync=self.fsync)
        served = {url: board.sources[url].ok - ok_before[url] for url in holders
                  if board.sources[url].ok > ok_before[url]}
        return _Fetched(staging, downloader.stats, len(done), served)

    async def _download_unless_superseded(
        self, session: aiohttp.ClientSession, downloader: Downloader, todo: list[int], manifest: Manifest
    ) -> None:
        """Run the download; give it up for a newer version when it stalls and a newer one is out.

        A relay that sees a newer version stops fetching the older one (pre-emption), so a client in
        the middle of the older version would wait for shards that never come. When no byte arrived
        for `stall_s` seconds and a source offers a newer version whose manifest verifies (signed by
        the trainer, same run: an unsigned index alone cannot make us drop a pull), the pull restarts
        on that version. A download that makes progress is never interrupted.
        """
        download = asyncio.create_task(downloader.run(todo))
        watch = asyncio.create_task(self._newer_when_stalled(session, downloader, manifest))
        try:
            await asyncio.wait({download, watch}, return_when=asyncio.FIRST_COMPLETED)
            if download.done():
                download.result()  # raises what the download raised
                return
            raise _Superseded(manifest.version, watch.result())
        finally:
            for task in (download, watch):
                task.cancel()
            await asyncio.gather(download, watch, return_exceptions=True)

    async def _newer_when_stalled(self, session: aiohttp.ClientSession, downloader: Downloader,
                                  manifest: Manifest) -> int:
        """A verified newer version, once the download has stalled for `stall_s` (never returns otherwise)."""
        last_bytes, last_change = downloader.stats.bytes_fetched, time.monotonic()
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            now = time.monotonic()
            if downloader.stats.bytes_fetched != last_bytes:
                last_bytes, last_change = downloader.stats.bytes_fetched, now
                continue
            if now - last_change < self.stall_s:
                continue
            latest = await self.latest_available(session)
            for url, newest in latest.items():
                if newest is None or newest <= manifest.version or self.board.sources[url].banned:
                    continue
                if await self._verified_manifest(session, url, newest, run_id=manifest.run_id,
                                                 min_version=manifest.version + 1) is not None:
                    return newest
            last_change = now  # nothing newer yet: look again after another stall period

    def _progress_bar(self, manifest: Manifest, todo: list[int]) -> Any:
        if not self.progress:
            return None
        from tqdm import tqdm

        total = sum(manifest.shards[i].size for i in todo)
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"v{manifest.version}",
                    file=sys.stderr, mininterval=0.25)

    def _install_guarded(self, step: Any, version: int) -> None:
        """Run an install step; a file system that refuses it is a `StorageError` naming the directory."""
        try:
            step()
        except OSError as exc:
            raise StorageError(f"installing v{version} in {self.out_dir}: {exc.strerror or exc}"
                               f"{f' ({exc.filename})' if exc.filename else ''}") from exc

    def _install(self, signed: SignedManifest, staging: Path) -> None:
        version = signed.manifest.version
        manifests = self.out_dir / "manifests"
        manifests.mkdir(exist_ok=True)
        tmp = manifests / f".{version}.json.tmp"
        tmp.write_bytes(signed.to_bytes())
        os.replace(tmp, manifests / f"{version}.json")
        (staging / JOURNAL).unlink(missing_ok=True)
        (staging / STAGED_MANIFEST).unlink(missing_ok=True)
        final = self.out_dir / f"v{version}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        self._swap(version)
        for partial in (self.out_dir / ".partial").glob("*"):  # older pulls given up for this one, and this one's
            number = partial.name.split(".")[0]                 # other staging (a delta given up for the full weights)
            if number.isdigit() and int(number) <= version:
                shutil.rmtree(partial, ignore_errors=True)

    def _swap(self, version: int) -> None:
        """Point `current` at v<version> atomically, unless it already points at something newer."""
        installed = self.installed_version()
        if installed is not None and installed > version:
            return
        tmp = self.out_dir / f".current.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(f"v{version}", tmp)
        os.replace(tmp, self.out_dir / "current")
        self._retain(version)

    def _retain(self, current: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.out_dir.glob("v*") if p.name[1:].isdigit())
        for old in [v for v in versions if v != current][: max(0, len(versions) - self.keep)]:
            shutil.rmtree(self.out_dir / f"v{old}", ignore_errors=True)
            (self.out_dir / "manifests" / f"{old}.json").unlink(missing_ok=True)


class _Superseded(Exception):
    def __init__(self, old: int, new: int) -> None:
        self.old, self.new = old, new


class _NothingNewer(Exception):
    def __init__(self, version: int) -> None:
        self.version = version


def pull(sources: list[str], *, trainer: str, out_dir: str | Path, version: int | None = None, **kwargs: Any) -> PullResult:
    """Blocking convenience wrapper around `Client.pull` (for scripts; async code uses `Client`)."""
    return asyncio.run(Client(sources, trainer=trainer, out_dir=out_dir, **kwargs).pull(version))
