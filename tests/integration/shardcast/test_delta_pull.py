"""Delta versions through an origin and a relay: a client that holds nothing rebuilds the chain from its anchor,
one holding v-1 fetches only the delta, a relay serving a tampered delta is banned, a delta reproducing another
version's weights is refused by the chain's hash; a base chain withheld (an anchor, or a delta in it) gives way to the
version's full weights, as does a chain dearer than them; and a version nobody serves either way stops the pull with a
typed error."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from safetensors.numpy import save_file
from shardcast_harness import run

from bench.adversaries import FakeRelay
from bench.loopback import same_tree, start_site
from protocol.errors import RelayError
from protocol.identity import Identity
from shardcast import Client, Origin, Relay
from shardcast.errors import DeltaBaseError
from shardcast.follower import Follower, VersionUnavailable
from shardcast.manifest import Manifest, ShardEntry, SignedManifest
from shardcast.publisher import DeltaBase, publish_blocking

pytestmark = pytest.mark.timeout(90)

KiB = 1024


@pytest.fixture
def trainer() -> Identity:
    return Identity.create()


def _weights(seed: int, steps: int) -> dict[str, np.ndarray]:
    """fp32 weights after `steps` sparse updates (2% of positions each)."""
    rng = np.random.default_rng(seed)
    state = {"a": rng.standard_normal((256, 64)).astype(np.float32), "b": rng.standard_normal(4096).astype(np.float32)}
    for step in range(steps):
        step_rng = np.random.default_rng(1000 + step)
        for tensor in state.values():
            flat = tensor.reshape(-1)
            idx = step_rng.choice(flat.size, size=flat.size // 50, replace=False)
            flat[idx] += 0.125
    return state


def _checkpoint(directory: Path, steps: int) -> Path:
    directory.mkdir(parents=True)
    save_file(_weights(0, steps), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"steps": steps}))
    return directory


def _publish_chain(tmp: Path, trainer: Identity, versions: int, store: Path) -> list[tuple[Path, Manifest]]:
    """v1 an anchor, each later version a delta against the one before."""
    published: list[tuple[Path, Manifest]] = []
    for v in range(1, versions + 1):
        ckpt = _checkpoint(tmp / f"ckpt{v}", v)
        base = DeltaBase(*published[-1]) if published else None
        signed = publish_blocking(ckpt, store, identity=trainer, run_id="r", version=v, shard_size=16 * KiB,
                                  dtype="float32", base=base)
        published.append((ckpt, signed.manifest))
    return published


@pytest.mark.parametrize("full_kept", [True, False], ids=["origin-keeps-full", "no-full-copy"])
def test_a_client_holding_nothing_takes_the_cheaper_way_and_one_holding_v_minus_1_fetches_only_the_delta(
        tmp_path: Path, trainer: Identity, full_kept: bool) -> None:
    """Holding nothing, the chain (anchor + deltas) is dearer than v3's full weights: the client takes those through
    the relay, which fetches them from the origin on demand; with no full copy anywhere it rebuilds the chain."""
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")
    assert chain[0][1].delta is None and all(m.delta is not None for _, m in chain[1:])
    if not full_kept:
        for v in (2, 3):
            shutil.rmtree(tmp_path / "origin" / "versions" / str(v) / "full")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=5) as relay:
            client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False, wait_s=20)
            result = await client.pull(3)
            assert result.version == 3 and result.whole == full_kept
            assert same_tree(tmp_path / "out" / "current", chain[2][0])
            if full_kept:  # the relay passed v3's full weights through, checked, and keeps them
                assert result.bytes_fetched == chain[2][1].full_bytes and not (tmp_path / "out" / "v1").exists()
                assert len(list((tmp_path / "relay" / "versions" / "3" / "full").iterdir())) == \
                    len(chain[2][1].weight_shards)
            else:  # v1 (anchor), then v2, then v3
                assert same_tree(tmp_path / "out" / "v2", chain[1][0])
            # a second client holding v2 fetches v3's delta alone: a small share of the full weights
            second = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out2", progress=False, wait_s=20)
            await second.pull(1)
            await second.pull(2)
            third = await second.pull(3)
            assert third.bytes_fetched == chain[2][1].total_bytes < 0.2 * chain[2][1].full_bytes
            assert same_tree(tmp_path / "out2" / "current", chain[2][0])
    run(body())
    # what a node or validator asks before serving: the installed manifest is the one the chain recorded
    follower = Follower([], trainer=trainer.address, out_dir=tmp_path / "out2", run_id="r", keep=5)
    assert same_tree(follower.verified(3, chain[2][1].content_hash()), chain[2][0])


def test_a_delta_is_rebuilt_off_the_event_loop_which_keeps_serving(tmp_path: Path, trainer: Identity,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rebuilding a version from its delta reads and hashes the full weights (seconds for a large model): it runs
    beside the client's event loop, never on it, so the origin and relay in that loop (a node's other work, in a
    node) keep answering meanwhile. The rebuild waits until the loop has answered a request; on the loop it would
    wait alone and fail."""
    import threading

    from shardcast import delta_route

    chain = _publish_chain(tmp_path, trainer, 2, tmp_path / "origin")
    rebuilding, answered = threading.Event(), threading.Event()
    real = delta_route.apply_delta

    def apply_while_the_loop_answers(*args: object) -> None:
        rebuilding.set()
        assert answered.wait(30), "the event loop answered nothing while the delta was being rebuilt"
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(delta_route, "apply_delta", apply_while_the_loop_answers)

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin, \
                Relay([origin.url], trainer=trainer.address, store_root=tmp_path / "relay", poll_wait_s=5) as relay:
            client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False, wait_s=20)
            await client.pull(1)

            async def answer_during_the_rebuild() -> None:
                assert await asyncio.to_thread(rebuilding.wait, 30)
                async with aiohttp.ClientSession() as session, session.get(f"{relay.url}/health") as response:
                    assert response.status == 200
                answered.set()

            result, _ = await asyncio.gather(client.pull(2), answer_during_the_rebuild())
            assert result.version == 2 and not result.whole
            assert same_tree(tmp_path / "out" / "current", chain[1][0])
    run(body())


async def _async(value: web.Response) -> web.Response:
    return value


def test_a_relay_serving_a_tampered_delta_is_banned_and_the_weights_come_whole(tmp_path: Path, trainer: Identity) -> None:
    chain = _publish_chain(tmp_path, trainer, 2, tmp_path / "origin")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            state = origin.store.get(2)
            assert state is not None and state.manifest.delta is not None
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            await client.pull(1)

            async def manifest(request: web.Request) -> web.Response:
                return web.Response(body=state.raw)

            async def shard(request: web.Request) -> web.Response:
                entry: ShardEntry = state.manifest.shards[int(request.match_info["i"])]
                good = bytearray(state.shard_path(entry.index).read_bytes())
                good[-1] ^= 0x01  # one changed value of the delta
                return web.Response(body=bytes(good))

            def index(request: web.Request) -> Awaitable[web.Response]:
                return _async(web.json_response({"run_id": "r", "latest": 2, "versions": [
                    {"version": 2, "complete": True, "shards": len(state.manifest.shards), "bytes": 1}]}))

            async with FakeRelay({"/versions": index, "/v/2/manifest": manifest,
                                  "/v/2/shards/{i}": shard}) as fake:
                client = Client([fake.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                progress=False, concurrency=2)
                result = await client.pull(2)
                assert result.sources[fake.url]["banned"] is True
                assert fake.hits.get("/v/2/shards/{i}", 0) >= 1
                assert same_tree(tmp_path / "out" / "current", chain[1][0])
    run(body())


def test_a_delta_reproducing_another_versions_weights_is_refused_by_the_chains_hash(
        tmp_path: Path, trainer: Identity) -> None:
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")
    real_v3_hash = chain[2][1].content_hash()
    # a validly signed v3 that is a delta against v2 reproducing v2's weights (the key signed what was never
    # recorded on chain): its own signature and shard table agree, only the chain tells it apart
    forged_store = tmp_path / "forged"
    for v, (ckpt, _) in enumerate(chain[:2], start=1):
        publish_blocking(ckpt, forged_store, identity=trainer, run_id="r", version=v, shard_size=16 * KiB,
                         base=None if v == 1 else DeltaBase(chain[0][0], SignedManifest.parse(
                             (forged_store / "versions" / "1" / "manifest.json").read_bytes()).manifest))
    v2_forged = SignedManifest.parse((forged_store / "versions" / "2" / "manifest.json").read_bytes()).manifest
    publish_blocking(tmp_path / "ckpt2", forged_store, identity=trainer, run_id="r", version=3, shard_size=16 * KiB,
                     base=DeltaBase(tmp_path / "ckpt1", SignedManifest.parse(
                         (forged_store / "versions" / "1" / "manifest.json").read_bytes()).manifest))
    assert v2_forged.delta is not None

    async def body() -> None:
        async with Origin(forged_store, run_id="r", shard_size=16 * KiB) as origin:
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            assert (await client.pull(3)).version == 3
            assert same_tree(tmp_path / "out" / "v3", chain[1][0])  # it did rebuild v2's weights as "v3"
    run(body())
    follower = Follower([], trainer=trainer.address, out_dir=tmp_path / "out", run_id="r", keep=5)
    with pytest.raises(VersionUnavailable):
        follower.verified(3, real_v3_hash)


class WithholdingRelay:
    """A relay in front of an origin that passes every request through but those `withheld` names: it answers them
    404, or (`hang`) accepts them and never answers."""

    def __init__(self, upstream: str, withheld: Callable[[str], bool], *, hang: bool = False) -> None:
        self.upstream, self.withheld, self.hang = upstream, withheld, hang
        self.asked: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path)
        if self.withheld(request.path):
            if self.hang:
                await asyncio.Event().wait()  # accepted, never answered (until the server shuts down)
            raise web.HTTPNotFound()
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs) as answer:
            body = await answer.read()
            return web.Response(status=answer.status, body=body if request.method != "HEAD" else None,
                                headers={"Content-Type": answer.headers.get("Content-Type", "application/octet-stream")})

    async def __aenter__(self) -> WithholdingRelay:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await start_site(app, shutdown_timeout=0.5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None and self._session is not None
        await self._runner.cleanup()
        await self._session.close()


@pytest.mark.parametrize("hang", [False, True], ids=["404", "hang"])
def test_a_withheld_anchor_gives_way_to_the_full_weights_of_the_version(
        tmp_path: Path, trainer: Identity, hang: bool) -> None:
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin, \
                WithholdingRelay(origin.url, lambda path: path.startswith("/v/1/"), hang=hang) as relay:
            client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False,
                            read_timeout_s=0.5, unavailable_s=0.5, manifest_timeout_s=0.5)
            result = await client.pull(3)
            assert result.version == 3 and result.whole
            assert same_tree(tmp_path / "out" / "current", chain[2][0])
            assert result.bytes_fetched == chain[2][1].full_bytes
            assert any(path.startswith("/v/3/full/") for path in relay.asked)
    run(body())
    follower = Follower([], trainer=trainer.address, out_dir=tmp_path / "out", run_id="r", keep=5)
    assert same_tree(follower.verified(3, chain[2][1].content_hash()), chain[2][0])


@pytest.mark.parametrize("hang", [False, True], ids=["404", "hang"])
def test_a_withheld_delta_in_the_chain_gives_way_to_the_full_weights(
        tmp_path: Path, trainer: Identity, hang: bool) -> None:
    """A client holding v1 needs v2's and v3's deltas (far cheaper than v3 whole); the relay withholds v2's delta
    shards: the pull tries the chain, gives it up, and installs v3 from its full weights."""
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            await client.pull(1)
            async with WithholdingRelay(origin.url, lambda path: path.startswith("/v/2/shards/"), hang=hang) as relay:
                client = Client([relay.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False,
                                read_timeout_s=0.5, unavailable_s=0.5, manifest_timeout_s=0.5)
                result = await client.pull(3)
                assert result.version == 3 and result.whole
                assert any(path.startswith("/v/2/shards/") for path in relay.asked)  # the chain was tried first
                assert same_tree(tmp_path / "out" / "current", chain[2][0])
    run(body())
    follower = Follower([], trainer=trainer.address, out_dir=tmp_path / "out", run_id="r", keep=5)
    assert same_tree(follower.verified(3, chain[2][1].content_hash()), chain[2][0])


def test_a_client_far_behind_takes_the_full_weights_when_they_are_cheaper_than_the_chain(
        tmp_path: Path, trainer: Identity) -> None:
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")
    anchor_and_deltas = sum(m.total_bytes for _, m in chain)
    assert anchor_and_deltas > chain[2][1].full_bytes

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            result = await client.pull(3)
            assert result.whole and result.bytes_fetched == chain[2][1].full_bytes
            assert client.installed_version() == 3 and not (tmp_path / "out" / "v1").exists()
            assert same_tree(tmp_path / "out" / "current", chain[2][0])
    run(body())


def test_a_version_whose_base_chain_and_full_weights_nobody_serves_stops_the_pull_with_a_typed_error(
        tmp_path: Path, trainer: Identity) -> None:
    _publish_chain(tmp_path, trainer, 2, tmp_path / "origin")
    shutil.rmtree(tmp_path / "origin" / "versions" / "1")  # the anchor withheld
    shutil.rmtree(tmp_path / "origin" / "versions" / "2" / "full")  # and v2's full weights

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False,
                            wait_s=2, unavailable_s=0.5)
            with pytest.raises(RelayError):
                await client.pull(2)
            assert client.installed_version() is None
    run(body())


@pytest.mark.parametrize("full_served", [True, False], ids=["full-served", "nothing-else"])
def test_a_delta_against_another_base_than_the_one_held_is_never_applied_to_it(
        tmp_path: Path, trainer: Identity, full_served: bool) -> None:
    """The client holds the real v2; a relay serves a v3 (validly signed: the key equivocated) that is a delta against
    another v2. The delta is never applied to the v2 held: the pull takes v3's full weights where a source has them,
    and otherwise fails with `DeltaBaseError`, the v2 held untouched."""
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")
    other = _checkpoint(tmp_path / "other2", 7)  # another v2's weights
    forged = tmp_path / "forged"
    v1 = publish_blocking(chain[0][0], forged, identity=trainer, run_id="r", version=1, shard_size=16 * KiB).manifest
    v2 = publish_blocking(other, forged, identity=trainer, run_id="r", version=2, shard_size=16 * KiB,
                          base=DeltaBase(chain[0][0], v1)).manifest
    v3 = publish_blocking(chain[2][0], forged, identity=trainer, run_id="r", version=3, shard_size=16 * KiB,
                          base=DeltaBase(other, v2)).manifest
    assert v3.delta is not None and v3.delta.base_weights != chain[1][1].weights_hash()
    if not full_served:
        shutil.rmtree(forged / "versions" / "3" / "full")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            client = Client([origin.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False)
            await client.pull(1)
            await client.pull(2)
        async with Origin(forged, run_id="r", shard_size=16 * KiB) as liar:
            client = Client([liar.url], trainer=trainer.address, out_dir=tmp_path / "out", progress=False,
                            unavailable_s=0.5)
            if full_served:
                result = await client.pull(3)
                assert result.whole and same_tree(tmp_path / "out" / "v3", chain[2][0])
            else:
                with pytest.raises(DeltaBaseError):
                    await client.pull(3)
                assert client.installed_version() == 2
            assert same_tree(tmp_path / "out" / "v2", chain[1][0])  # the v2 held, untouched
    run(body())


def test_a_relay_serving_tampered_full_weights_of_a_delta_version_is_banned(tmp_path: Path, trainer: Identity) -> None:
    chain = _publish_chain(tmp_path, trainer, 3, tmp_path / "origin")

    async def body() -> None:
        async with Origin(tmp_path / "origin", run_id="r", shard_size=16 * KiB) as origin:
            state = origin.store.get(3)
            assert state is not None and state.manifest.delta is not None

            async def manifest(request: web.Request) -> web.Response:  # every version's, as the origin's
                held = origin.store.get(int(request.match_info["n"]))
                assert held is not None
                return web.Response(body=held.raw)

            async def full(request: web.Request) -> web.Response:
                path = state.full_path(int(request.match_info["i"]))
                assert path is not None
                good = bytearray(path.read_bytes())
                good[-1] ^= 0x01  # one changed byte of the full weights
                return web.Response(body=bytes(good))

            def index(request: web.Request) -> Awaitable[web.Response]:
                return _async(web.json_response({"run_id": "r", "latest": 3, "versions": [
                    {"version": 3, "complete": True, "shards": len(state.manifest.shards), "bytes": 1}]}))

            async with FakeRelay({"/versions": index, "/v/{n}/manifest": manifest, "/v/3/full/{i}": full}) as fake:
                client = Client([fake.url, origin.url], trainer=trainer.address, out_dir=tmp_path / "out",
                                progress=False, concurrency=2)
                result = await client.pull(3)  # holding nothing: the full weights are cheaper than the chain
                assert result.whole and result.sources[fake.url]["banned"] is True
                assert fake.hits.get("/v/3/full/{i}", 0) >= 1
                assert same_tree(tmp_path / "out" / "current", chain[2][0])
    run(body())
