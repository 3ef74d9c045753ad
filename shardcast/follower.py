"""Follow the relays in a background thread and hand out versions only once they match the chain.

Nodes and validators both need the same thing from SHARDCAST: keep installing the newest policy
version (`Client.follow`, asyncio, in a thread of its own so a synchronous role can use it), and
give a version's checkpoint directory out only when its installed manifest is signed by the run's
trainer *and* its `content_hash` equals the hash the chain recorded for that version. The chain is
the authority: a relay (or the trainer's origin) that serves a validly signed manifest which was
never published, or was replaced, is refused here (`VersionUnavailable`, naming why).

The expected hash comes from the caller (`verified(version, want)`, and `expected` for the background
thread), so this library does not read the chain itself. The chain's current version installed under another
manifest counts as missing and is pulled again (the client replaces it); relays that keep serving that other
manifest are backed off from like a failed pull, counted (`mismatched`) and named in `last_error`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from protocol.errors import PrimeError, RelayError
from shardcast.client import Client, PullResult
from shardcast.errors import ManifestError
from shardcast.manifest import SignedManifest

log = logging.getLogger(__name__)


class VersionUnavailable(RelayError):
    """A policy version is not installed here yet, or what is installed does not match the chain."""

    code = "version_unavailable"


class Follower:
    """Installs each new version from `relays` into `out_dir` until `stop()` (see the module docstring)."""

    def __init__(self, relays: list[str], *, trainer: str, out_dir: Path, run_id: str | None, keep: int,
                 poll_s: float = 5.0, progress: bool | None = False,
                 wanted: Callable[[], int | None] | None = None,
                 learned: Callable[[], list[str]] | None = None,
                 on_install: Callable[[PullResult], None] | None = None,
                 expected: Callable[[int], bytes | None] | None = None) -> None:
        self.relays = list(relays)
        self.learned = learned
        """More relay URLs (announced over discovery): the client is rebuilt when the set changes."""
        self.trainer = trainer
        self.out_dir = Path(out_dir)
        self.run_id = run_id
        self.keep = keep
        self.poll_s = poll_s
        self.progress = progress
        self.wanted = wanted
        """The version the chain says is current (pulled by number when missing, whatever the relays'
        newest is); without it, or when it is installed, the relays' newest is prefetched."""
        self.on_install = on_install
        self.expected = expected
        """The manifest hash the chain recorded for a version (None: not published yet). With it, the chain's
        version installed under another manifest (a relay served other weights, another run's files) counts as
        missing and is pulled again; without it, whatever is installed counts."""
        self.mismatched = 0
        """Pulls after which the chain's version was still installed under another manifest (the relays serve
        that other manifest): each one backs off as a failed pull does."""
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what is installed -----------------------------------------------------------------------

    def installed(self) -> list[int]:
        """Versions with a checkpoint directory and a manifest on disk, oldest first (not yet verified)."""
        found = []
        for path in self.out_dir.glob("v*"):
            if path.name[1:].isdigit() and path.is_dir() and (self.out_dir / "manifests" / f"{path.name[1:]}.json").is_file():
                found.append(int(path.name[1:]))
        return sorted(found)

    def verified(self, version: int, want: bytes | None) -> Path:
        """The checkpoint directory of `version`, if its manifest is the trainer's and hashes to `want`."""
        path = self.out_dir / f"v{version}"
        manifest_file = self.out_dir / "manifests" / f"{version}.json"
        if not path.is_dir() or not manifest_file.is_file():
            raise VersionUnavailable(f"policy version {version} is not installed yet")
        if want is None:
            raise VersionUnavailable(f"policy version {version} is not published on chain (yet)")
        try:
            signed = SignedManifest.parse(manifest_file.read_bytes())
            signed.verify(trainer=self.trainer)
        except (OSError, ManifestError) as exc:
            raise VersionUnavailable(f"installed v{version} has an unusable manifest: {exc}") from exc
        if signed.manifest.version != version or (self.run_id is not None and signed.manifest.run_id != self.run_id):
            raise VersionUnavailable(f"installed v{version} holds the manifest of v{signed.manifest.version} of run "
                                     f"{signed.manifest.run_id!r}")
        got = signed.manifest.content_hash()
        if got != want:
            raise VersionUnavailable(f"installed v{version} has manifest hash 0x{got.hex()}, the chain recorded "
                                     f"0x{want.hex()}: refused")
        return path

    def mismatch(self, version: int) -> str | None:
        """Why installed `version` is not the chain's (`verified`'s refusal), or None when it is, when it is not
        installed, or when the chain has no hash for it (yet) or no `expected` was given."""
        want = self.expected(version) if self.expected is not None else None
        if want is None or version not in self.installed():
            return None
        try:
            self.verified(version, want)
        except VersionUnavailable as exc:
            return str(exc)
        return None

    # -- the background thread --------------------------------------------------------------------

    def sources(self) -> list[str]:
        """The configured relays, then the learned ones (each once)."""
        extra = self.learned() if self.learned is not None else []
        return list(dict.fromkeys([u.rstrip("/") for u in [*self.relays, *extra]]))

    def start(self) -> None:
        if self._thread is not None or (not self.relays and self.learned is None):
            return
        self._thread = threading.Thread(target=self._run, name="shardcast-follow", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                asyncio.run(self._follow_until_stopped())
            except PrimeError as exc:
                self.last_error = str(exc)
                log.warning("weights: following the relays failed (retrying): %s", exc)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one failure
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("weights: follower crashed (restarting)")
            self._stop.wait(self.poll_s)

    async def _follow_until_stopped(self) -> None:
        sources = self.sources()
        if not sources:
            return  # nothing to follow yet (no relay configured or announced): asked again after poll_s
        client = Client(sources, trainer=self.trainer, out_dir=self.out_dir, run_id=self.run_id, keep=self.keep,
                        progress=self.progress)
        task = asyncio.ensure_future(self._follow(client))
        while not self._stop.is_set() and not task.done():
            await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def _follow(self, client: Client) -> None:
        """Pull the chain's version when it is missing, else the relays' newest; then wait for news."""
        backoff = 0.5
        while True:
            if self.learned is not None and self.sources() != client.sources:
                log.info("weights: relays now %s", ", ".join(self.sources()))
                return  # rebuilt with the new set by the caller's loop
            target = self.wanted() if self.wanted is not None else None
            have = set(self.installed())
            if target is not None and target in have and self.mismatch(target) is not None:
                have.discard(target)  # installed, but not the chain's: pulled again (the client replaces it)
            try:
                result = await client.pull(target if target is not None and target not in have else None)
            except RelayError as exc:
                self.last_error = str(exc)
                log.warning("weights: %s; retrying within %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                continue
            wrong = self.mismatch(target) if target is not None and result.version == target else None
            if wrong is not None:
                self.mismatched += 1
                self.last_error = wrong
                log.warning("weights: %s, after pulling it again from %s: the relays serve another manifest than "
                            "the chain's; retrying within %.1f s", wrong, ", ".join(client.sources), backoff)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                continue
            backoff = 0.5
            self.last_error = None
            if result.version not in have:
                log.info("weights: installed v%d (%d shards fetched, %.1f s)", result.version, result.fetched_shards,
                         result.seconds)
                if self.on_install is not None:
                    self.on_install(result)
            # a newer version at the relays wakes us at once; the chain's target is looked at every poll_s
            started = time.monotonic()
            if await client.wait_for_version(max(self.installed(), default=-1), self.poll_s) is None:
                await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))  # sources that fail fast
