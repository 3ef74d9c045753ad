"""Liveness against hostile peers on 127.0.0.1: relays whose upstreams lie, spin or forge, and servers
whose clients read slowly, not at all, or never finish their request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from shardcast_harness import ThrottleProxy, closed_by_peer, connect_from, holds_complete, run, wait_until

from bench.adversaries import FakeRelay
from bench.loopback import make_checkpoint, same_tree
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.manifest import sign_manifest
from shardcast.server import ServeLimits

pytestmark = pytest.mark.timeout(90)

KiB = 1024
MiB = 1024 * 1024
HOSTILE = "127.0.0.2"  # hostile peers connect from here; honest clients from 127.0.0.1


@pytest.fixture
def trainer() -> Identity:
    return Identity.create()


def _index(latest: int | None) -> web.Response:
    versions = [] if latest is None else [{"version": latest, "complete": True, "shards": 1, "bytes": 1}]
    return web.json_response({"run_id": "r", "latest": latest, "versions": versions})


# -- a relay's upstreams ---------------------------------------------------------------------------


@pytest.mark.parametrize("manifest_answer", ["404", "hang"])
def test_relay_takes_the_honest_version_while_another_upstream_announces_one_it_cannot_back(
    tmp_path: Path, trainer: Identity, manifest_answer: str
) -> None:
    """The liar answers every long-poll at once with version 999999, and then 404 (or nothing at all) for
    its manifest; it is also the closer upstream (the honest one sits behind 50 ms of latency)."""
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 80 * KiB}, seed=v) for v in (1, 2)]

    async def lie_manifest(request: web.Request) -> web.Response:
        if manifest_answer == "hang":
            await asyncio.sleep(3600)
        raise web.HTTPNotFound()

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=32 * KiB) as origin, \
                FakeRelay({"/versions": lambda r: _async(_index(999999)),
                           "/v/999999/manifest": lie_manifest}) as liar:
            await origin.wait_published(origin.publish(ckpts[0]))
            far = ThrottleProxy(origin.server.port, rate=1e12, latency=0.05)
            await far.start()
            try:
                async with Relay([liar.url, far.url], trainer=trainer.address, store_root=tmp_path / "relay",
                                 poll_wait_s=5) as relay:
                    await wait_until(lambda: holds_complete(relay.url, 1), timeout=20)
                    await origin.wait_published(origin.publish(ckpts[1]))
                    await wait_until(lambda: holds_complete(relay.url, 2), timeout=20)
                    result = await Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                          progress=False).pull()
                    assert result.version == 2 and same_tree(tmp_path / "out" / "current", ckpts[1])
                    assert relay.announced[liar.url] == 999999  # it still claims it; nothing believed it
                    assert not relay.board.sources[liar.url].banned  # a 404 is no proof of lying
            finally:
                await far.stop()
    run(body())


def test_an_upstream_answering_the_long_poll_at_once_is_polled_with_backoff(tmp_path: Path, trainer: Identity) -> None:
    """A relay's only upstream ignores `wait` and answers every poll at once (it proxies a real origin, so
    its versions are genuine): the relay backs off instead of spinning, and still takes new versions."""
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 40 * KiB}, seed=v) for v in (1, 2)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin, \
                aiohttp.ClientSession() as session:
            async def forward(request: web.Request) -> web.Response:
                path = request.path if request.path != "/versions" else "/versions?after=-1&wait=0"
                async with session.get(origin.url + path) as r:
                    return web.Response(status=r.status, body=await r.read())

            async with FakeRelay({"/versions": forward, "/v/{n}/manifest": forward,
                                  "/v/{n}/shards/{i}": forward}) as spinner:
                await origin.wait_published(origin.publish(ckpts[0]))
                async with Relay([spinner.url], trainer=trainer.address, store_root=tmp_path / "relay",
                                 poll_wait_s=30) as relay:
                    await wait_until(lambda: holds_complete(relay.url, 1), timeout=20)
                    before = spinner.hits["/versions"]
                    await asyncio.sleep(2.0)  # a window in which to count polls (before the fix: ~1,000/s)
                    polls = spinner.hits["/versions"] - before
                    assert polls <= 8, polls  # 0.25 + 0.5 + 1 s of backoff fit in 2 s
                    await origin.wait_published(origin.publish(ckpts[1]))
                    await wait_until(lambda: holds_complete(relay.url, 2), timeout=30)
    run(body())


def test_relay_bans_an_upstream_with_a_forged_manifest_across_retries_versions_and_restarts(
    tmp_path: Path, trainer: Identity
) -> None:
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 40 * KiB}, seed=v) for v in (1, 2, 3)]
    forger_key = Identity.create()

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            manifest = (await origin.wait_published(origin.publish(ckpts[0]))).manifest
            forged = sign_manifest(forger_key, manifest.model_copy(update={"version": 5})).to_bytes()

            async def forged_manifest(request: web.Request) -> web.Response:
                return web.Response(body=forged)

            async with FakeRelay({"/versions": lambda r: _async(_index(5)), "/v/5/manifest": forged_manifest}) as forger:
                store = tmp_path / "relay"
                async with Relay([forger.url, origin.url], trainer=trainer.address, store_root=store,
                                 poll_wait_s=5) as relay:
                    await wait_until(lambda: holds_complete(relay.url, 1), timeout=20)

                    async def banned() -> bool:
                        return relay.board.sources[forger.url].banned
                    await wait_until(banned, timeout=20)
                    hits = dict(forger.hits)
                    assert hits["/v/5/manifest"] == 1
                    await origin.wait_published(origin.publish(ckpts[1]))
                    await wait_until(lambda: holds_complete(relay.url, 2), timeout=20)
                    assert forger.hits == hits  # not asked again, not even its index
                doc = json.loads((store / "bans.json").read_text())
                assert forger.url in doc and "signed by" in doc[forger.url]["reason"]
                assert origin.url not in doc

                # A restarted relay remembers the ban (<store>/bans.json).
                async with Relay([forger.url, origin.url], trainer=trainer.address, store_root=store,
                                 poll_wait_s=5) as relay:
                    assert relay.board.sources[forger.url].banned
                    await origin.wait_published(origin.publish(ckpts[2]))
                    await wait_until(lambda: holds_complete(relay.url, 3), timeout=20)
                    assert forger.hits == hits
    run(body())


def test_a_relay_ban_runs_out(tmp_path: Path, trainer: Identity) -> None:
    """With a short `ban_s`, the relay asks a banned upstream again once the ban has run out."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 20 * KiB})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            forged = b'{"manifest": 1}'

            async def bad_manifest(request: web.Request) -> web.Response:
                return web.Response(body=forged)

            async with FakeRelay({"/versions": lambda r: _async(_index(5)), "/v/5/manifest": bad_manifest}) as liar, \
                    Relay([liar.url, origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=2,
                          ban_s=1.0) as relay:
                async def asked_twice() -> bool:
                    return liar.hits.get("/v/5/manifest", 0) >= 2
                await wait_until(asked_twice, timeout=20)  # banned once, lifted, banned again
                await wait_until(lambda: holds_complete(relay.url, 1), timeout=20)
    run(body())


async def _async(value: web.Response) -> web.Response:
    return value


def test_client_follow_is_not_woken_by_a_source_announcing_a_version_it_cannot_back(
    tmp_path: Path, trainer: Identity
) -> None:
    """The client's side of the same liar: `follow` long-polls its sources between installs; a source
    answering every poll at once with 999999 (then 404) must neither make it spin nor hide v2."""
    ckpts = [make_checkpoint(tmp_path / f"ckpt{v}", {"w.bin": 40 * KiB}, seed=v) for v in (1, 2)]

    async def lie_manifest(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin, \
                FakeRelay({"/versions": lambda r: _async(_index(999999)),
                           "/v/999999/manifest": lie_manifest}) as liar:
            await origin.wait_published(origin.publish(ckpts[0]))
            client = Client([liar.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            installed: asyncio.Queue[int] = asyncio.Queue()

            async def follow() -> None:
                async for result in client.follow(poll_s=30):
                    installed.put_nowait(result.version)

            task = asyncio.create_task(follow())
            try:
                assert await asyncio.wait_for(installed.get(), 20) == 1
                before = liar.hits["/versions"]
                await asyncio.sleep(2.0)  # a window in which to count polls
                polls = liar.hits["/versions"] - before
                assert polls <= 4, polls
                assert not client.board.sources[liar.url].banned
                await origin.wait_published(origin.publish(ckpts[1]))
                assert await asyncio.wait_for(installed.get(), 20) == 2
                assert same_tree(tmp_path / "out" / "current", ckpts[1])
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    run(body())


# -- a server's clients ----------------------------------------------------------------------------


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def _slow_readers(port: int, count: int, path: str) -> list[socket.socket]:
    """`count` connections from HOSTILE that ask for `path` and then read nothing; returned once each
    has its response head (so the server is sending to all of them)."""
    def open_one() -> socket.socket:
        sock = connect_from(HOSTILE, port, rcvbuf=4096)
        sock.sendall(_request(path))
        sock.settimeout(10)
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
        return sock
    return list(await asyncio.gather(*(asyncio.to_thread(open_one) for _ in range(count))))


def test_an_honest_pull_completes_while_slow_readers_hold_connections(tmp_path: Path, trainer: Identity) -> None:
    """20 clients ask for a 16 MiB shard and read nothing (more than the server's 16 send threads); an
    honest pull of the same version completes while the server still holds all of them."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 32 * MiB})
    limits = ServeLimits(send_grace_s=600)  # nothing is cut during the test: the pull must not need it

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * MiB,
                          limits=limits) as origin:
            await origin.wait_published(origin.publish(ckpt))
            readers = await _slow_readers(origin.server.port, 20, "/v/1/shards/0")
            try:
                result = await asyncio.wait_for(
                    Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False).pull(),
                    timeout=25,  # the send threads used to be held 30 s by each stalled reader
                )
                assert result.version == 1 and same_tree(tmp_path / "out" / "current", ckpt)
                assert origin.server.open_connections(HOSTILE) == 20
                assert origin.server.metrics.registry.get_sample_value("shardcast_slow_readers_cut_total") == 0
            finally:
                for sock in readers:
                    sock.close()
    run(body())


@pytest.mark.parametrize("reader", ["stalled", "trickling"])
def test_a_reader_below_the_rate_floor_is_cut_off(tmp_path: Path, trainer: Identity, reader: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 16 * MiB})
    limits = ServeLimits(min_send_rate=1 * MiB, send_grace_s=1.0)

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * MiB,
                          limits=limits) as origin:
            await origin.wait_published(origin.publish(ckpt))
            [sock] = await _slow_readers(origin.server.port, 1, "/v/1/shards/0")
            received = 0

            def cut() -> bool:
                return bool(origin.server.metrics.registry.get_sample_value("shardcast_slow_readers_cut_total"))

            def read_until_cut() -> bool:
                """Reads nothing (stalled) or 4 KiB every 20 ms (trickling: ~200 KiB/s) until the server cuts
                the connection; False if it never does."""
                nonlocal received
                sock.settimeout(0.02)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if reader == "stalled":
                        time.sleep(0.02)
                        if cut():
                            return closed_by_peer(sock)  # reset: nothing more arrives
                        continue
                    try:
                        data = sock.recv(4096)
                    except TimeoutError:
                        continue
                    except ConnectionError:
                        return True
                    if not data:
                        return True
                    received += len(data)
                    time.sleep(0.02)
                return False

            try:
                assert await asyncio.to_thread(read_until_cut)
                assert received < 16 * MiB
                assert origin.server.metrics.registry.get_sample_value("shardcast_slow_readers_cut_total") == 1
                # The server is still fine for everyone else.
                result = await Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                      progress=False).pull()
                assert same_tree(tmp_path / "out" / "current", ckpt) and result.version == 1
            finally:
                sock.close()
    run(body())


def test_half_sent_request_heads_are_capped_per_peer_and_timed_out(tmp_path: Path, trainer: Identity) -> None:
    """250 connections from one peer each send half a request head and wait: all but `max_conns_per_peer`
    are turned away at once, the rest closed after `head_timeout_s`; honest pulls go on meanwhile."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 200 * KiB})
    limits = ServeLimits(max_conns_per_peer=16, head_timeout_s=8.0)  # longer than opening 250 connections takes

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=64 * KiB,
                          limits=limits) as origin:
            await origin.wait_published(origin.publish(ckpt))

            def half_sent(count: int) -> list[socket.socket]:
                socks = [connect_from(HOSTILE, origin.server.port) for _ in range(count)]
                for sock in socks:
                    with contextlib.suppress(ConnectionError):  # a refused one may be reset already
                        sock.sendall(b"GET /v/1/shards/0 HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
                return socks

            socks = await asyncio.to_thread(half_sent, 250)
            try:
                async def settled() -> bool:
                    return origin.server.metrics.registry.get_sample_value("shardcast_connections_refused_total") == 234
                await wait_until(settled, timeout=20)
                assert origin.server.open_connections(HOSTILE) == 16
                result = await Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                      progress=False).pull()
                assert same_tree(tmp_path / "out" / "current", ckpt) and result.version == 1

                async def all_closed() -> bool:
                    return all(closed_by_peer(s) for s in socks)
                await wait_until(all_closed, timeout=20)
                assert origin.server.open_connections(HOSTILE) == 0
            finally:
                for sock in socks:
                    sock.close()
    run(body())
