"""Origin -> relays -> clients on 127.0.0.1: bad relays, killed relays, resume, convergence, load."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from shardcast_harness import RelayProcess, ThrottleProxy, holds_complete, run, wait_until

from bench.loopback import make_checkpoint, same_tree
from protocol.errors import RelayError
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.publisher import publish_blocking

pytestmark = pytest.mark.timeout(90)

KiB = 1024
MiB = 1024 * 1024


@pytest.fixture
def trainer() -> Identity:
    return Identity.create()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 3 * MiB + 123, "config.json": 300, "tok/vocab.txt": 70 * KiB})


def test_pull_through_relay_installs_atomically(tmp_path: Path, trainer: Identity, checkpoint: Path) -> None:
    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=256 * KiB) as origin:
            version = origin.publish(checkpoint)
            async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=5) as relay:
                await origin.wait_published(version)
                await wait_until(lambda: holds_complete(relay.url, version))
                out = tmp_path / "out"
                result = await Client([relay.url], trainer=trainer.address, out_dir=out, progress=False).pull()
                assert result.version == version == 1
                assert os.readlink(out / "current") == "v1"
                assert same_tree(out / "current", checkpoint)
                assert not (out / ".partial" / "1").exists()
                assert result.fetched_shards == len(result.manifest.shards)
                # The relay served it all; the origin served the relay once, not the client.
                assert relay.server.metrics.count("shard", 200) == len(result.manifest.shards)
    run(body())


def test_relay_flipping_bytes_is_banned_and_pull_completes(tmp_path: Path, trainer: Identity, checkpoint: Path) -> None:
    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=256 * KiB) as origin:
            version = origin.publish(checkpoint)
            await origin.wait_published(version)
            async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "evil", poll_wait_s=5) as evil, \
                    Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "good", poll_wait_s=5) as good:
                await wait_until(lambda: holds_complete(evil.url, version))
                await wait_until(lambda: holds_complete(good.url, version))
                # The evil relay's operator flips one byte in every shard it serves.
                for shard_file in (tmp_path / "evil" / "versions" / "1" / "shards").iterdir():
                    data = bytearray(shard_file.read_bytes())
                    data[len(data) // 2] ^= 0x01
                    shard_file.write_bytes(bytes(data))
                client = Client([evil.url, good.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
                result = await client.pull()
                assert same_tree(tmp_path / "out" / "current", checkpoint)
                assert result.sources[evil.url]["banned"] is True
                assert "hash" in str(result.sources[evil.url]["ban_reason"])
                assert result.hash_failures >= 1
                assert result.sources[good.url]["banned"] is False
    run(body())


def test_relay_killed_mid_transfer_fails_over_with_range_resume(tmp_path: Path, trainer: Identity) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", {"weights.bin": 16 * MiB})

    async def body() -> None:
        # Shards larger than loopback socket buffers, so the kill really lands mid-shard.
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=8 * MiB) as origin:
            version = origin.publish(checkpoint)
            await origin.wait_published(version)
            relay = RelayProcess([origin.url], trainer.address, tmp_path / "relay")
            proxy = ThrottleProxy(relay.port, rate=4 * MiB)
            try:
                await wait_until(lambda: holds_complete(relay.url, version), timeout=30)
                await proxy.start()
                client = Client([proxy.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                concurrency=2, progress=False)
                pull = asyncio.create_task(client.pull())

                async def some_bytes_through() -> bool:
                    return proxy.forwarded > 256 * KiB
                await wait_until(some_bytes_through, timeout=20, interval=0.01)
                relay.kill()  # SIGKILL while a shard is half-way through the proxy
                result = await pull
            finally:
                relay.kill()
                await proxy.stop()
            assert same_tree(tmp_path / "out" / "current", checkpoint)
            assert result.sources[proxy.url]["failures"] >= 1
            assert result.sources[proxy.url]["banned"] is False  # dying is not lying
            assert result.range_resumes >= 1
    run(body())


def test_killed_pull_resumes_without_refetching_verified_shards(tmp_path: Path, trainer: Identity) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", {"weights.bin": 4 * MiB})
    out = tmp_path / "out"

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=256 * KiB) as origin:
            version = origin.publish(checkpoint)
            signed = await origin.wait_published(version)
            shards = len(signed.manifest.shards)
            proxy = ThrottleProxy(origin.server.port, rate=1 * MiB)
            await proxy.start()
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "pull", "--from", proxy.url,
                    "--trainer", trainer.address, "--out", str(out), "--concurrency", "1", "--no-progress",
                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
                )
                journal = out / ".partial" / "1" / ".journal"

                async def some_verified() -> bool:
                    return journal.exists() and len(journal.read_text().split()) >= 3
                await wait_until(some_verified, timeout=30, interval=0.02)
                proc.kill()
                await proc.wait()
            finally:
                await proxy.stop()
            verified = len(journal.read_text().split())
            assert 3 <= verified < shards
            before = origin.server.metrics.count("shard", 200)
            result = await Client([origin.url], trainer=trainer.address, out_dir=out, progress=False).pull()
            fetched = origin.server.metrics.count("shard", 200) - before
            assert result.reused_shards == verified
            assert fetched == result.fetched_shards == shards - verified
            assert same_tree(out / "current", checkpoint)
    run(body())


def test_back_to_back_versions_converge_on_newest_with_retention(tmp_path: Path, trainer: Identity) -> None:
    checkpoints = [make_checkpoint(tmp_path / f"ckpt{i}", {"weights.bin": 1 * MiB + i}, seed=i) for i in range(3)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=128 * KiB, retention=2) as origin:
            async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", retention=2,
                             poll_wait_s=5) as relay:
                versions = [origin.publish(c) for c in checkpoints]  # returns at once; work runs behind
                assert versions == [1, 2, 3]
                await wait_until(lambda: holds_complete(relay.url, 3))
                assert origin.store.versions() == [2, 3]
                # The relay may skip v2 (it converges on the newest); it never holds more than 2.
                assert len(relay.store.versions()) <= 2 and relay.store.latest == 3
                assert sorted(p.name for p in (tmp_path / "relay" / "versions").iterdir() if p.name.isdigit()) \
                    == [str(v) for v in relay.store.versions()]
                out = tmp_path / "out"
                result = await Client([relay.url], trainer=trainer.address, out_dir=out, progress=False).pull()
                assert result.version == 3
                assert same_tree(out / "current", checkpoints[2])
    run(body())


def test_twenty_concurrent_clients(tmp_path: Path, trainer: Identity) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", {"weights.bin": 2 * MiB + 5, "config.json": 100})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=trainer, shard_size=256 * KiB) as origin:
            version = origin.publish(checkpoint)
            async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "r1", poll_wait_s=5) as r1, \
                    Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "r2", poll_wait_s=5) as r2:
                await origin.wait_published(version)
                # No waiting for the relays: clients race them and are served as shards arrive.
                await wait_until(lambda: _advertised(r1, r2, version))
                clients = [Client([r1.url, r2.url], trainer=trainer.address, out_dir=tmp_path / f"c{i}", progress=False,
                                  concurrency=4) for i in range(20)]
                results = await asyncio.gather(*(c.pull() for c in clients))
                assert all(r.version == version for r in results)
                for i in range(20):
                    assert same_tree(tmp_path / f"c{i}" / "current", checkpoint)
                shards = len(results[0].manifest.shards)
                served = r1.server.metrics.count("shard", 200) + r2.server.metrics.count("shard", 200)
                assert served == 20 * shards
    run(body())


async def _advertised(r1: Relay, r2: Relay, version: int) -> bool:
    return r1.store.get(version) is not None and r2.store.get(version) is not None


def test_relay_survives_upstream_restart(tmp_path: Path, trainer: Identity) -> None:
    async def body() -> None:
        store = tmp_path / "origin"
        origin = Origin(store, run_id="run-a", identity=trainer, shard_size=128 * KiB)
        await origin.start()
        port = origin.server.port
        origin.publish(make_checkpoint(tmp_path / "c1", {"w.bin": 300 * KiB}, seed=1))
        async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=2) as relay:
            await wait_until(lambda: holds_complete(relay.url, 1))
            await origin.stop()
            # While the origin is down, the trainer publishes v2 into its store (CLI path).
            publish_blocking(make_checkpoint(tmp_path / "c2", {"w.bin": 200 * KiB}, seed=2), store,
                             identity=trainer, run_id="run-a", shard_size=128 * KiB)
            async def poll_failed() -> bool:  # the relay's polls fail (and back off) while the origin is down
                return (relay.server.metrics.registry.get_sample_value("shardcast_upstream_errors_total") or 0) >= 1

            await wait_until(poll_failed, timeout=30)
            origin = Origin(store, run_id="run-a", port=port)
            await origin.start()
            try:
                await wait_until(lambda: holds_complete(relay.url, 2), timeout=30)
                assert relay.server.metrics.registry.get_sample_value("shardcast_upstream_errors_total") >= 1
            finally:
                await origin.stop()
    run(body())


def test_wrong_trainer_key_is_refused_by_relay_and_client(tmp_path: Path, trainer: Identity, checkpoint: Path) -> None:
    impostor = Identity.create()

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="run-a", identity=impostor, shard_size=1 * MiB) as origin:
            version = origin.publish(checkpoint)
            await origin.wait_published(version)
            async with Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=1) as relay:
                async def manifest_fetched() -> bool:  # a loaded machine may take a while to get there
                    return origin.server.metrics.count("manifest", 200) >= 1

                await wait_until(manifest_fetched, timeout=30)
                await asyncio.sleep(1.0)  # a window in which to count its refetches (an upper bound: backoff)
                assert relay.store.latest is None  # never advertised
                assert 1 <= origin.server.metrics.count("manifest", 200) <= 5  # refused, then backs off
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            with pytest.raises(RelayError, match="signed by"):
                await client.pull()
            assert client.board.sources[origin.url].banned
            assert not (tmp_path / "out" / "current").exists()
    run(body())
