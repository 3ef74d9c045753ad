"""A relay's learned upstreams (issue 23, item 12): one per announcing signer (its newest), a bounded number in
all, and a learned upstream that is dead or lying gives its slot to the next one announced, while a healthy one
keeps it. Real origins, a real forger and dead ports on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from netfixtures import free_port
from shardcast_harness import run, wait_until

from bench.adversaries import FakeRelay
from bench.loopback import make_checkpoint
from protocol.identity import Identity
from shardcast import Origin, Relay
from shardcast.manifest import sign_manifest
from shardcast.relay import DEAD_AFTER

pytestmark = pytest.mark.timeout(90)
KiB = 1024


def test_learned_upstreams_are_one_per_signer_bounded_and_evicted_by_health(tmp_path: Path) -> None:
    trainer, forger_key = Identity.create(), Identity.create()
    ckpt = make_checkpoint(tmp_path / "ckpt", {"w.bin": 20 * KiB})
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(4)]

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", identity=trainer, shard_size=16 * KiB) as origin, \
                Origin(tmp_path / "healthy", run_id="r", identity=trainer, shard_size=16 * KiB) as healthy:
            manifest = (await origin.wait_published(origin.publish(ckpt))).manifest
            forged = sign_manifest(forger_key, manifest.model_copy(update={"version": 5})).to_bytes()

            async def forged_manifest(request: web.Request) -> web.Response:
                return web.Response(body=forged)

            async def index(request: web.Request) -> web.Response:
                return web.json_response({"run_id": "r", "latest": 5, "versions": [
                    {"version": 5, "complete": True, "shards": 1, "bytes": 1}]})

            async with FakeRelay({"/versions": index, "/v/5/manifest": forged_manifest}) as forger, \
                    Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=1) as relay:
                # a signer's newer announcement replaces its older URL; it never adds a second one
                assert relay.add_upstream(dead[0], signer="0xA", max_learned=2)
                assert relay.add_upstream(dead[1], signer="0xA", max_learned=2)
                assert relay.learned == {dead[1]: "0xA"} and dead[0] not in relay.upstreams
                assert relay.add_upstream(healthy.url, signer="0xB", max_learned=2)
                # full: a dead learned upstream gives its slot to the next one; the configured one is never counted
                dead_source = relay.board.sources[dead[1]]

                async def is_dead() -> bool:
                    return dead_source.consecutive_failures >= DEAD_AFTER

                await wait_until(is_dead, timeout=30)
                assert relay.add_upstream(forger.url, signer="0xC", max_learned=2)
                assert relay.learned == {healthy.url: "0xB", forger.url: "0xC"} and dead[1] not in relay.upstreams

                # a lying one (a manifest the trainer did not sign: banned) frees its slot too; the healthy one stays
                async def forger_banned() -> bool:
                    return relay.board.sources[forger.url].banned

                await wait_until(forger_banned, timeout=30)
                assert relay.add_upstream(dead[2], signer="0xD", max_learned=2)
                assert relay.learned == {healthy.url: "0xB", dead[2]: "0xD"}
                # and a banned URL announced again (by anyone) is not followed while its ban lasts
                assert not relay.add_upstream(forger.url, signer="0xE", max_learned=3)

                # every learned upstream healthy: a newcomer is refused, nobody is pushed out
                async def healthy_polled() -> bool:
                    return relay.polls.get(healthy.url, 0) >= 2

                await wait_until(healthy_polled, timeout=30)
                assert relay.drop_upstream(dead[2], "test: make room for a healthy pair")
                assert relay.add_upstream(origin.url + "/", signer="0xF", max_learned=2) is False  # configured already
                other = Origin(tmp_path / "other", run_id="r", identity=trainer, shard_size=16 * KiB)
                async with other:
                    assert relay.add_upstream(other.url, signer="0xG", max_learned=2)

                    async def other_polled() -> bool:
                        return relay.polls.get(other.url, 0) >= 2

                    await wait_until(other_polled, timeout=30)
                    assert not relay.add_upstream(dead[3], signer="0xH", max_learned=2)
                    assert relay.learned == {healthy.url: "0xB", other.url: "0xG"}
                    assert relay.board.sources[healthy.url].consecutive_failures == 0

    run(body(), timeout=80)
