"""What a pull leaves on disk: every file of the checkpoint (even one named like the client's own
bookkeeping), resumable partial pulls in the old and new layouts, repaired damaged installs, and a
typed error when the disk cannot hold a version."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from shardcast_harness import REPO, run

from bench.adversaries import FakeRelay
from bench.loopback import make_checkpoint, same_tree
from protocol.errors import PrimeError, RelayError
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.client import JOURNAL, STAGED_MANIFEST
from shardcast.errors import StorageError
from shardcast.follower import Follower, VersionUnavailable
from shardcast.manifest import MAX_SHARD_BYTES, Manifest, ShardEntry, SignedManifest, now_ms, sign_manifest

pytestmark = pytest.mark.timeout(90)

KiB = 1024


@pytest.fixture
def trainer() -> Identity:
    return Identity.create()


def _checkpoint(directory: Path, seed: int = 0) -> Path:
    """A checkpoint whose files include `manifest.json` at the top and further down."""
    return make_checkpoint(directory, {"manifest.json": 48 * KiB + 7, "w.bin": 96 * KiB, "sub/manifest.json": 90},
                           seed=seed)


@pytest.mark.parametrize("reader", ["Client.pull", "prime-relay pull", "Client.follow"])
def test_a_checkpoint_with_its_own_manifest_json_installs_whole(tmp_path: Path, trainer: Identity, reader: str) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=5) as relay:
            await origin.wait_published(origin.publish(ckpt))
            client = Client([relay.url], trainer=trainer.address, out_dir=out, progress=False, wait_s=20)
            if reader == "Client.pull":
                assert (await client.pull()).version == 1
            elif reader == "Client.follow":
                async for result in client.follow(poll_s=5):
                    assert result.version == 1
                    break
            else:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "pull", "--from", relay.url,
                    "--trainer", trainer.address, "--out", str(out), "--wait", "20", "--json", "--no-progress",
                    cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
                )
                stdout, _ = await proc.communicate()
                assert proc.returncode == 0 and json.loads(stdout)["version"] == 1
        assert same_tree(out / "current", ckpt)  # manifest.json included, byte for byte
        assert SignedManifest.parse((out / "manifests" / "1.json").read_bytes()).manifest.version == 1
        assert not (out / ".partial" / "1").exists()
    run(body())


async def _partial_pull(client: Client, shards: int) -> None:
    """A pull that dies after `shards` verified shards (the hook raises), leaving `.partial/<N>/` behind."""
    seen: list[int] = []

    def die_after(shard: ShardEntry) -> None:
        seen.append(shard.index)
        if len(seen) == shards:
            raise RuntimeError("killed")
    client.on_shard = die_after
    with pytest.raises(RuntimeError, match="killed"):
        await client.pull()
    client.on_shard = None


def test_a_partial_pull_keeps_its_bookkeeping_under_dot_names_and_resumes(tmp_path: Path, trainer: Identity) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            signed = await origin.wait_published(origin.publish(ckpt))
            client = Client([origin.url], trainer=trainer.address, out_dir=out, progress=False, concurrency=1)
            await _partial_pull(client, 2)
            staging = out / ".partial" / "1"
            assert (staging / STAGED_MANIFEST).read_bytes() == signed.to_bytes()
            assert len((staging / JOURNAL).read_text().split()) == 2
            # The checkpoint's own manifest.json is being written in place, at its own size.
            assert (staging / "manifest.json").stat().st_size == (ckpt / "manifest.json").stat().st_size
            result = await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            assert result.reused_shards == 2 and result.fetched_shards == len(signed.manifest.shards) - 2
        assert same_tree(out / "current", ckpt)
        assert sorted(p.name for p in (out / "current").iterdir()) == ["manifest.json", "sub", "w.bin"]
    run(body())


@pytest.mark.parametrize("has_manifest_json", [False, True])
def test_a_partial_pull_staged_by_an_older_client_is_finished_whole(tmp_path: Path, trainer: Identity,
                                                                  has_manifest_json: bool) -> None:
    """Older clients kept the staged manifest as `.partial/<N>/manifest.json`. That is bookkeeping, not a
    file to install, when the checkpoint has no such file (the pull resumes); when it has one, it was
    overwritten, so the pull starts over."""
    ckpt = _checkpoint(tmp_path / "ckpt") if has_manifest_json else make_checkpoint(
        tmp_path / "ckpt", {"w.bin": 96 * KiB, "config.json": 300})
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            signed = await origin.wait_published(origin.publish(ckpt))
            client = Client([origin.url], trainer=trainer.address, out_dir=out, progress=False, concurrency=1)
            await _partial_pull(client, 2)
            staging = out / ".partial" / "1"
            os.replace(staging / STAGED_MANIFEST, staging / "manifest.json")  # the old layout
            result = await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            assert result.reused_shards == (0 if has_manifest_json else 2)
            assert result.fetched_shards + result.reused_shards == len(signed.manifest.shards)
        assert same_tree(out / "current", ckpt)  # no stray manifest.json, none missing
    run(body())


def test_an_install_that_lost_a_file_is_pulled_again(tmp_path: Path, trainer: Identity) -> None:
    """Clients before the dot-named bookkeeping installed such a checkpoint without its manifest.json; a
    pull of that version notices the missing file and installs it whole instead of reporting success."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            (out / "v1" / "manifest.json").unlink()  # what an older client left
            result = await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            assert result.version == 1 and result.fetched_shards == len(result.manifest.shards)
        assert same_tree(out / "current", ckpt)
    run(body())


def test_a_version_installed_from_another_manifest_is_pulled_again(tmp_path: Path, trainer: Identity) -> None:
    """A client holding v1 and its manifest from one publication (the trainer started over, an out_dir kept from
    an earlier run of the same id) does not take it for the v1 the sources sign now: files of the same names and
    sizes, other bytes. It fetches every shard again and installs the signed manifest and weights."""
    old, new = _checkpoint(tmp_path / "old", seed=0), _checkpoint(tmp_path / "new", seed=1)
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin-old", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(old))
            await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
        async with Origin(tmp_path / "origin-new", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(new))
            result = await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            signed = (tmp_path / "origin-new" / "versions" / "1" / "manifest.json").read_bytes()
        assert result.version == 1 and result.fetched_shards == len(result.manifest.shards)
        assert (out / "manifests" / "1.json").read_bytes() == signed
    run(body())
    assert same_tree(out / "current", new) and not same_tree(new, old)


def _huge_manifest(run_id: str, size: int) -> Manifest:
    """A manifest declaring a small file and one of `size` bytes in 1 GiB shards (hashes are never
    checked: no shard is fetched)."""
    shards = [ShardEntry(index=0, file=0, offset=0, size=10, hash="0" * 64)]
    for offset in range(0, size, MAX_SHARD_BYTES):
        shards.append(ShardEntry(index=len(shards), file=1, offset=offset, size=min(MAX_SHARD_BYTES, size - offset),
                                 hash="0" * 64))
    return Manifest(run_id=run_id, version=1, created_at_ms=now_ms(), shard_size=MAX_SHARD_BYTES,
                    files=({"path": "small.bin", "size": 10}, {"path": "huge.bin", "size": size}),
                    shards=tuple(shards))


@pytest.mark.parametrize("size", ["twice the free space", "17 TiB"])
def test_a_version_larger_than_the_disk_is_a_storage_error_naming_the_file(tmp_path: Path, trainer: Identity,
                                                                          size: str) -> None:
    """A (trainer-signed) manifest declares more than the disk holds: a `StorageError` naming the file,
    before any shard is fetched, and no half-made version left behind. (17 TiB is also past ext4's
    largest file.)"""
    stat = os.statvfs(tmp_path)
    nbytes = 2 * stat.f_bavail * stat.f_frsize + MAX_SHARD_BYTES if size.startswith("twice") else 17 << 40
    signed = sign_manifest(trainer, _huge_manifest("r", nbytes))
    raw = signed.to_bytes()
    out = tmp_path / "out"

    async def manifest(request: web.Request) -> web.Response:
        return web.Response(body=raw)

    async def index(request: web.Request) -> web.Response:
        return web.json_response({"run_id": "r", "latest": 1, "versions": []})

    async def shard(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def body() -> None:
        async with FakeRelay({"/versions": index, "/v/1/manifest": manifest, "/v/1/shards/{i}": shard}) as relay:
            with pytest.raises(StorageError, match="huge.bin") as caught:
                await Client([relay.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            assert isinstance(caught.value, RelayError) and isinstance(caught.value, PrimeError)
            assert "/v/1/shards/{i}" not in relay.hits
        assert not (out / ".partial" / "1").exists()
        assert not (out / "v1").exists()
    run(body(), timeout=60)


def test_prime_relay_pull_reports_a_storage_error_and_exits_2(tmp_path: Path, trainer: Identity) -> None:
    """The CLI prints the typed error (naming the path) instead of a traceback: here the output directory
    cannot be created because a file stands where its parent should be."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 10 * KiB})
    (tmp_path / "blocker").write_text("a file, not a directory")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "pull", "--from", origin.url,
                "--trainer", trainer.address, "--out", str(tmp_path / "blocker" / "out"), "--no-progress",
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=asyncio.subprocess.PIPE,
            )
            _, stderr = await proc.communicate()
            assert proc.returncode == 2, stderr
            assert b"StorageError" in stderr and b"blocker" in stderr and b"Traceback" not in stderr
    run(body())



async def _follow_until(follower: Follower, done: Callable[[], bool], what: str) -> None:
    """Run `follower` (its own thread and loop) until `done()`, serving this loop's origins meanwhile."""
    follower.start()
    try:
        deadline = time.monotonic() + 45
        while not done():
            assert time.monotonic() < deadline, f"{what}: {follower.last_error}"
            await asyncio.sleep(0.1)
    finally:
        await asyncio.to_thread(follower.stop)


def test_the_follower_pulls_again_the_chains_version_installed_under_another_manifest(
        tmp_path: Path, trainer: Identity) -> None:
    """A node holds v1 from another publication (the trainer started over; the chain records the new v1) while the
    relays are already at v2, not on chain yet. The follower pulled only the relays' newest when the chain's version
    was installed, whatever its manifest, so v1 stayed refused by `verified` for the rest of the run. Now the chain's
    v1 is pulled again and verifies."""
    old, new, newer = (_checkpoint(tmp_path / n, seed=s) for n, s in (("old", 0), ("new", 1), ("newer", 2)))
    out = tmp_path / "out"
    chain: dict[int, bytes] = {}
    follower = Follower([], trainer=trainer.address, out_dir=out, run_id="r", keep=5, poll_s=0.5,
                        wanted=lambda: 1, expected=chain.get)

    async def body() -> None:
        async with Origin(tmp_path / "origin-old", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(old))
            await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
        async with Origin(tmp_path / "origin-new", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(new))
            await origin.wait_published(origin.publish(newer))
            signed = SignedManifest.parse((tmp_path / "origin-new" / "versions" / "1" / "manifest.json").read_bytes())
            chain[1] = signed.manifest.content_hash()
            with pytest.raises(VersionUnavailable, match="the chain recorded"):
                follower.verified(1, chain[1])
            follower.relays = [origin.url]
            await _follow_until(follower, lambda: 1 in follower.installed() and follower.mismatch(1) is None,
                                "v1 pulled again")
    run(body(), timeout=90)
    assert same_tree(follower.verified(1, chain[1]), new) and not same_tree(new, old)


def test_relays_that_serve_only_another_manifest_make_the_follower_back_off_and_say_why(
        tmp_path: Path, trainer: Identity) -> None:
    old, new = _checkpoint(tmp_path / "old", seed=0), _checkpoint(tmp_path / "new", seed=1)
    out = tmp_path / "out"
    chain: dict[int, bytes] = {}
    follower = Follower([], trainer=trainer.address, out_dir=out, run_id="r", keep=5, poll_s=0.5,
                        wanted=lambda: 1, expected=chain.get)

    async def body() -> None:
        async with Origin(tmp_path / "origin-new", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(new))  # the chain's v1, served by no relay we follow
        signed = SignedManifest.parse((tmp_path / "origin-new" / "versions" / "1" / "manifest.json").read_bytes())
        chain[1] = signed.manifest.content_hash()
        async with Origin(tmp_path / "origin-old", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(old))
            follower.relays = [origin.url]
            await _follow_until(follower, lambda: follower.mismatched >= 2, "the mismatch counted")
    run(body(), timeout=90)
    assert "the chain recorded" in (follower.last_error or "")
    with pytest.raises(VersionUnavailable):
        follower.verified(1, chain[1])
