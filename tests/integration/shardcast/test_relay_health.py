"""Relays that do not answer are remembered (issue 39 item 2): a hung relay costs a pull one short wait and
is then skipped until it answers again, and a manifest request to a slow relay is hedged."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from aiohttp import web
from netfixtures import ProxyProcess
from shardcast_harness import run, wait_until

from bench.adversaries import FakeRelay
from bench.loopback import make_checkpoint, same_tree
from protocol.identity import Identity
from shardcast import Client, Origin
from shardcast import client as client_module
from shardcast.transfer import new_session

pytestmark = pytest.mark.timeout(120)

KiB = 1024


def test_a_hung_relay_is_skipped_after_one_timeout_until_it_answers_again(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Identity.create()
    ckpts = [make_checkpoint(tmp_path / f"ckpt{i}", {"w.bin": (40 + i) * KiB}) for i in range(3)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            proxy = ProxyProcess(int(origin.url.rsplit(":", 1)[1]))  # the same relay, behind a process we can stop
            try:
                client = Client([proxy.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                progress=False)
                await origin.wait_published(origin.publish(ckpts[0]))
                first = await client.pull()
                assert first.version == 1 and first.sources[proxy.url]["hung"] is False

                proxy.signal(signal.SIGSTOP)  # accepts connections (the kernel's backlog), never answers
                await origin.wait_published(origin.publish(ckpts[1]))
                second = await client.pull()  # waits the others' grace once, not the index timeout
                assert second.version == 2 and same_tree(tmp_path / "out" / "current", ckpts[1])
                assert second.sources[proxy.url]["hung"] is True
                timeouts = second.sources[proxy.url]["timeouts"]
                assert timeouts >= 1

                await origin.wait_published(origin.publish(ckpts[2]))
                third = await client.pull()  # skipped: not asked, so not timed out again
                assert third.version == 3 and same_tree(tmp_path / "out" / "current", ckpts[2])
                assert third.sources[proxy.url] == {**third.sources[proxy.url], "hung": True, "timeouts": timeouts}

                proxy.signal(signal.SIGCONT)
                monkeypatch.setattr(client_module, "PROBE_S", 0.0)  # probe it on every pull from now on

                async def answers_again() -> bool:
                    async with new_session() as session:
                        await client.latest_available(session)
                    return not client.board.sources[proxy.url].hung
                await wait_until(answers_again, timeout=60, interval=0.2)
            finally:
                proxy.close()
    run(body(), timeout=110)


def test_a_manifest_request_to_a_silent_relay_is_hedged_to_the_next_holder(tmp_path: Path) -> None:
    trainer = Identity.create()
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 48 * KiB})

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin:
            await origin.wait_published(origin.publish(ckpt))
            index = (await _index(origin.url))

            async def versions(request: web.Request) -> web.Response:
                return web.Response(body=index, content_type="application/json")

            async def silent(request: web.Request) -> web.Response:
                await asyncio.sleep(3600)  # holds the request far past the manifest timeout
                return web.Response(status=500)

            async with FakeRelay({"/versions": versions, "/v/1/manifest": silent}) as slow:
                client = Client([slow.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                progress=False)
                result = await client.pull()  # without the hedge: the manifest timeout (60 s), then the test's
                assert result.version == 1 and same_tree(tmp_path / "out" / "current", ckpt)
                assert slow.hits.get("/v/1/manifest") == 1  # it was asked, and the next holder beside it
                assert result.sources[origin.url]["versions"] == 1 and result.sources[slow.url]["versions"] == 0
    run(body(), timeout=50)


async def _index(url: str) -> bytes:
    async with new_session() as session, session.get(f"{url}/versions") as response:
        return await response.read()
