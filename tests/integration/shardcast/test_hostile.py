"""The server against hostile requests, the client against hostile relays, and pipelining."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from shardcast_harness import ThrottleProxy, run, wait_until

from bench.adversaries import FakeRelay
from bench.loopback import make_checkpoint, same_tree
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.manifest import ShardEntry

pytestmark = pytest.mark.timeout(60)

KiB = 1024
MiB = 1024 * 1024


@pytest.fixture
def trainer() -> Identity:
    return Identity.create()


async def _raw_request(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return data


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_server_refuses_traversal_oversize_and_bad_queries(tmp_path: Path, trainer: Identity) -> None:
    (tmp_path / "secret.txt").write_text("TOP SECRET")
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 1000})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=400) as origin:
            await origin.wait_published(origin.publish(ckpt))
            port = origin.server.port
            for path in [b"/v/1/shards/../../../../secret.txt", b"/v/1/shards/%2e%2e%2fmanifest.json",
                         b"/v/1/../../secret.txt", b"/v/1/shards/-1", b"/v/1/shards/3", b"/v/1/shards/0x1",
                         b"/v/99/shards/0", b"/v/1/shards/" + b"9" * 20, b"/versions/../secret.txt",
                         b"//etc/passwd", b"/v/1/manifest.json"]:
                response = await _raw_request(port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert _status(response) in (400, 404), path
                assert b"SECRET" not in response and b"root:" not in response
            long_line = b"GET /v/1/shards/0?" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            assert _status(await _raw_request(port, long_line)) in (400, 414)
            big_header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n"
            assert _status(await _raw_request(port, big_header)) in (400, 431)
            assert _status(await _raw_request(port, b"GARBAGE\r\n\r\n")) == 400
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{origin.url}/versions", params={"after": "x"}) as r:
                    assert r.status == 400
                async with s.get(f"{origin.url}/versions", params={"wait": "nan-ish"}) as r:
                    assert r.status == 400
                async with s.post(f"{origin.url}/versions", data=b"z" * (2 * MiB)) as r:
                    assert r.status in (405, 413)
    run(body())


def test_range_head_health_metrics_and_long_poll(tmp_path: Path, trainer: Identity) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 5000})
    data = (ckpt / "w.bin").read_bytes()

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=4096) as origin, \
                aiohttp.ClientSession() as s:
            # Long-poll: asked before anything exists, answered when the version appears.
            poll = asyncio.create_task(s.get(f"{origin.url}/versions", params={"after": "0", "wait": "20"}))
            await asyncio.sleep(0.2)
            assert not poll.done()
            origin.publish(ckpt)
            async with await poll as r:
                assert (await r.json())["latest"] == 1
            async with s.get(f"{origin.url}/v/1/shards/0", headers={"Range": "bytes=100-199"}) as r:
                assert r.status == 206 and await r.read() == data[100:200]
            async with s.get(f"{origin.url}/v/1/shards/1", headers={"Range": "bytes=10-"}) as r:
                assert r.status == 206 and await r.read() == data[4096 + 10:]
            async with s.get(f"{origin.url}/v/1/shards/1", headers={"Range": "bytes=9000-"}) as r:
                assert r.status == 416
            async with s.head(f"{origin.url}/v/1/shards/0") as r:
                assert r.status == 200 and r.headers["Content-Length"] == "4096" and r.headers["Accept-Ranges"] == "bytes"
            async with s.get(f"{origin.url}/health") as r:
                health = await r.json()
                assert health["status"] == "ok" and health["role"] == "origin" and health["latest"] == 1
            async with s.get(f"{origin.url}/metrics") as r:
                text = await r.text()
                assert "shardcast_latest_version 1.0" in text
                assert 'shardcast_requests_total{endpoint="shard",status="206"} 2.0' in text
    run(body())


def _fake_index(version: int = 1) -> web.Response:
    return web.json_response({"run_id": "r", "latest": version,
                              "versions": [{"version": version, "complete": True, "shards": 1, "bytes": 1}]})


@pytest.mark.parametrize("kind", ["garbage", "oversize", "forged", "old_version"])
def test_client_bans_relay_with_bad_manifest_and_pulls_elsewhere(tmp_path: Path, trainer: Identity, kind: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 100 * KiB})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=32 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            genuine = origin.store.get(1).raw  # type: ignore[union-attr]

            async def manifest(request: web.Request) -> web.Response:
                if kind == "garbage":
                    return web.Response(body=b'{"manifest": [1, 2')
                if kind == "oversize":
                    return web.Response(body=b" " * (17 * MiB))
                doc = json.loads(genuine)
                if kind == "forged":
                    doc["manifest"]["shards"][0]["hash"] = "0" * 64  # would make clients accept other bytes
                else:
                    doc["manifest"]["version"] = 9  # replays v1's manifest as v9: signature breaks
                return web.Response(body=json.dumps(doc).encode())

            version = 9 if kind == "old_version" else 1
            async with FakeRelay({"/versions": lambda r: _async(_fake_index(version)),
                                  f"/v/{version}/manifest": manifest}) as fake:
                client = Client([fake.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
                result = await client.pull()
                assert result.version == 1
                assert same_tree(tmp_path / "out" / "current", ckpt)
                assert result.sources[fake.url]["banned"] is True
    run(body())


async def _async(value: web.Response) -> web.Response:
    return value


@pytest.mark.parametrize("kind", ["too_long", "truncated_then_close", "wrong_bytes"])
def test_client_handles_relays_serving_bad_shard_bytes(tmp_path: Path, trainer: Identity, kind: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 64 * KiB})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            state = origin.store.get(1)
            assert state is not None

            async def manifest(request: web.Request) -> web.Response:
                return web.Response(body=state.raw)

            async def shard(request: web.Request) -> web.StreamResponse:
                entry: ShardEntry = state.manifest.shards[int(request.match_info["i"])]
                good = state.shard_path(entry.index).read_bytes()
                if kind == "too_long":
                    return web.Response(body=good + b"extra")
                if kind == "wrong_bytes":
                    return web.Response(body=bytes(len(good)))
                response = web.StreamResponse(headers={"Content-Length": str(len(good))})
                await response.prepare(request)
                await response.write(good[: len(good) // 2])
                request.transport.close()  # type: ignore[union-attr]
                return response

            async with FakeRelay({"/versions": lambda r: _async(_fake_index()), "/v/1/manifest": manifest,
                                  "/v/1/shards/{i}": shard}) as fake:
                client = Client([fake.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                progress=False, concurrency=2)
                result = await client.pull()
                assert same_tree(tmp_path / "out" / "current", ckpt)
                assert fake.hits.get("/v/1/shards/{i}", 0) >= 1
                # what each source served that matched the signed hashes (a node ranks relays by it, issue 35
                # item 8): the liar nothing, whatever it answered; every fetched shard is someone's
                assert fake.url not in result.served and result.served.get(origin.url, 0) >= 1, result.served
                assert sum(result.served.values()) == result.fetched_shards
                # Lying gets a ban; a cut connection only a failure (and a Range resume elsewhere).
                assert result.sources[fake.url]["banned"] is (kind != "truncated_then_close")
                if kind == "truncated_then_close":
                    return
                # The ban outlives the pull: a later pull with this ban list never asks the liar.
                (tmp_path / "out2").mkdir()
                shutil.copy(tmp_path / "out" / "bans.json", tmp_path / "out2" / "bans.json")
                hits = dict(fake.hits)
                again = Client([fake.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out2",
                               progress=False)
                assert again.board.sources[fake.url].banned
                second = await again.pull(1)
                assert second.fetched_shards == len(state.manifest.shards)
                assert same_tree(tmp_path / "out2" / "current", ckpt)
                assert fake.hits == hits  # not even its index or manifest was asked for
                # --forget-bans lifts it.
                again.forget_bans()
                assert not (tmp_path / "out2" / "bans.json").exists()
                assert not Client([fake.url], trainer=trainer.address, out_dir=tmp_path / "out2",
                                  progress=False).board.sources[fake.url].banned
    run(body())


def test_relay_serves_shards_while_still_fetching(tmp_path: Path, trainer: Identity) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 2 * MiB})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=256 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            slow_link = ThrottleProxy(origin.server.port, rate=1 * MiB)  # origin -> relay at 1 MiB/s
            await slow_link.start()
            try:
                async with Relay([slow_link.url], trainer=trainer.address, store_root=tmp_path / "relay",
                                 concurrency=1, poll_wait_s=5) as relay:
                    async def advertised() -> bool:
                        return relay.store.get(1) is not None
                    await wait_until(advertised)
                    seen_incomplete: list[bool] = []
                    client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
                    client.on_shard = lambda shard: seen_incomplete.append(not relay.store.get(1).complete)  # type: ignore[union-attr]
                    await client.pull()
                    assert same_tree(tmp_path / "out" / "current", ckpt)
                    assert seen_incomplete[0] is True  # the client held verified shards before the relay had them all
                    assert relay.server.metrics.registry.get_sample_value("shardcast_pipelined_waits_total") >= 1
            finally:
                await slow_link.stop()
    run(body())
