"""Following a run: `Client.follow` and `prime-relay pull --follow` install each newer version, only newer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from netfixtures import free_port
from shardcast_harness import REPO, run

from bench.loopback import make_checkpoint, same_tree
from protocol.identity import Identity
from shardcast import Client, Origin, PullResult, Relay

pytestmark = pytest.mark.timeout(90)
KiB = 1024


def test_follow_installs_newer_versions_through_a_relay_and_never_goes_back(tmp_path: Path) -> None:
    trainer = Identity.create()
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 96 * KiB, "config.json": 40}, seed=v) for v in (1, 2, 3, 4)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-f", identity=trainer, shard_size=32 * KiB) as origin, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=5) as relay:
            client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "node", progress=False, keep=2)
            seen: list[PullResult] = []
            arrived = asyncio.Event()

            async def follow() -> None:
                async for result in client.follow(poll_s=5):
                    seen.append(result)
                    arrived.set()

            task = asyncio.create_task(follow())
            try:
                origin.publish(ckpts[0])
                await asyncio.wait_for(arrived.wait(), 30)
                assert [r.version for r in seen] == [1]
                for ckpt in ckpts[1:3]:  # two versions back to back
                    origin.publish(ckpt)
                while client.installed_version() != 3:
                    arrived.clear()
                    await asyncio.wait_for(arrived.wait(), 30)
                versions = [r.version for r in seen]
                assert versions == sorted(set(versions)) and versions[-1] == 3  # increasing; 2 may be skipped
                assert same_tree(tmp_path / "node" / "current", ckpts[2])
                # keep=2: the two newest installs stay
                assert sorted(p.name for p in (tmp_path / "node").glob("v*")) == [f"v{v}" for v in versions[-2:]]
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

            # A restarted follower does not report what is already installed, only what is new.
            again = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "node", progress=False)
            results: list[int] = []

            async def follow_again() -> None:
                async for result in again.follow(poll_s=5):
                    results.append(result.version)
                    return

            second = asyncio.create_task(follow_again())
            await asyncio.sleep(0.5)
            assert results == [] and not second.done()
            origin.publish(ckpts[3])
            await asyncio.wait_for(second, 30)
            assert results == [4]
            assert same_tree(tmp_path / "node" / "current", ckpts[3])
    run(body(), timeout=80)


def test_cli_follow_waits_for_the_origin_then_installs_each_version_and_stops_on_sigterm(tmp_path: Path) -> None:
    trainer = Identity.create()
    keystore = trainer.save_keystore(tmp_path / "trainer.json", "pw")
    store, out = tmp_path / "store", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PRIME_KEYSTORE_PASSWORD": "pw"}
    cli = [sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING"]

    def publish(seed: int) -> None:
        ckpt = make_checkpoint(tmp_path / f"ckpt{seed}", {"model.bin": 200_000}, seed=seed)
        subprocess.run([*cli, "publish", str(ckpt), "--store", str(store), "--run-id", "run-c", "--keystore",
                        str(keystore), "--shard-mib", "1"], env=env, check=True, capture_output=True, timeout=60)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The follower starts first: nothing listens yet, so it must keep retrying, not exit.
    follower = subprocess.Popen([*cli, "pull", "--from", url, "--trainer", trainer.address, "--out", str(out),
                                 "--follow", "--json", "--poll", "5"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    origin = None
    try:
        publish(1)
        origin = subprocess.Popen([*cli, "origin", "--store", str(store), "--run-id", "run-c", "--port", str(port)],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert follower.stdout is not None
        first = json.loads(follower.stdout.readline())
        assert first["version"] == 1 and first["fetched_shards"] == 1
        publish(2)
        second = json.loads(follower.stdout.readline())
        assert second["version"] == 2
        assert os.readlink(out / "current") == "v2"
        assert same_tree(out / "current", tmp_path / "ckpt2")
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(15) == 0
    finally:
        for proc in (follower, origin):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.parametrize("newer", ["signed", "forged"])
def test_latest_pull_stalled_on_an_abandoned_version_moves_to_a_newer_signed_one(tmp_path: Path, newer: str) -> None:
    """A relay that pre-empted v1 never serves its missing shards; a `latest` pull switches to v2, but only
    to a v2 whose manifest verifies: an index alone (unsigned) cannot make a client drop its pull."""
    from aiohttp import web

    from bench.adversaries import FakeRelay
    from protocol.errors import RelayError

    trainer = Identity.create()
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 64 * KiB}, seed=v) for v in (1, 2)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-s", identity=trainer, shard_size=16 * KiB) as origin:
            for ckpt in ckpts:
                await origin.wait_published(origin.publish(ckpt))
            state = {"latest": 1}

            async def index(request: web.Request) -> web.Response:
                v = state["latest"]
                return web.json_response({"run_id": "run-s", "latest": v, "versions": [
                    {"version": n, "complete": n == 2, "shards": 4, "bytes": 64 * KiB} for n in range(1, v + 1)]})

            async def manifest(request: web.Request) -> web.Response:
                v = int(request.match_info["v"])
                held = origin.store.get(v)
                assert held is not None
                if v == 2 and newer == "forged":
                    return web.Response(body=held.raw.replace(b'"run-s"', b'"run-x"'))  # signature breaks
                return web.Response(body=held.raw)

            async def shard(request: web.Request) -> web.StreamResponse:
                v, i = int(request.match_info["v"]), int(request.match_info["i"])
                if v == 1:  # abandoned: v2 is out now, and v1's shards will never come
                    state["latest"] = 2
                    return web.Response(status=503, headers={"Retry-After": "1"})
                held = origin.store.get(v)
                assert held is not None
                return web.Response(body=held.shard_path(i).read_bytes())

            async with FakeRelay({"/versions": index, "/v/{v}/manifest": manifest, "/v/{v}/shards/{i}": shard}) as relay:
                client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "node", progress=False,
                                stall_s=1.0, ban_s=0)
                if newer == "forged":
                    with pytest.raises(RelayError, match="banned"):
                        await client.pull()
                    assert "manifest" in (client.board.sources[relay.url].ban_reason or "")
                    assert client.installed_version() is None
                    return
                result = await client.pull()
                assert result.version == 2
                assert same_tree(tmp_path / "node" / "current", ckpts[1])
                assert not (tmp_path / "node" / ".partial" / "1").exists()  # the abandoned pull is cleaned up
    run(body(), timeout=60)
