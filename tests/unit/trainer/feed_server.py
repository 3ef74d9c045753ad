"""A real HTTP server on 127.0.0.1 that serves a validator's trainer feed (`GET /v1/feed`), in a thread.

It serves what a validator serves (validator/app.py): `FeedItem` envelopes sealed with a real key,
listed after a cursor, each page with its signed `FeedPage` listing. Tests add items (good ones, or forged ones built here), and can queue
misbehaving responses that are answered once each, before the normal listing.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web

from bench.loopback import start_site
from protocol.canonical import canonical_bytes, to_hex
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.rollout import (
    FeedEntry,
    FeedGroup,
    FeedItem,
    FeedPage,
    FeedSample,
    feed_item_hash,
    submission_domain,
)
from protocol.seeds import work_key

RUN_ID = "run-feed"
POOL = "0x" + "ab" * 20
CHAIN_ID = 31337
DOMAIN = submission_domain(CHAIN_ID, POOL, RUN_ID)
NODE = Identity.create().address

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def feed_item(version: int, counter: int, *, groups: int = 1, size: int = 4, vocab: int = 64,
              seed: int | None = None, node: str = NODE) -> FeedItem:
    """An accepted submission of `node`'s `counter`-th batch at `version`: `groups` tasks of `size` samples."""
    rng = random.Random(f"{version}-{counter}" if seed is None else seed)
    out = []
    for _ in range(groups):
        rewards = [float(rng.random() < 0.5) for _ in range(size)]
        if len(set(rewards)) == 1:  # keep a learning signal in every group
            rewards[0] = 1.0 - rewards[0]
        samples = []
        for k in range(size):
            n = rng.randint(2, 6)
            samples.append(FeedSample(tokens=tuple(rng.randrange(3, vocab) for _ in range(n)),
                                      logprobs=tuple(-round(rng.uniform(0.5, 6.0), 3) for _ in range(n)),
                                      reward=rewards[k]))
        out.append(FeedGroup(task_id=f"{rng.getrandbits(128):032x}",
                             prompt_tokens=tuple(rng.randrange(3, vocab) for _ in range(4)), samples=tuple(samples)))
    return FeedItem(run_id=RUN_ID, work_key=work_key(RUN_ID, node, version, counter, chain_id=CHAIN_ID, pool=POOL), node=node,
                    policy_version=version, env="synthetic", env_version="1", groups=tuple(out))


@dataclass
class Listed:
    seq: int
    work_key: str
    envelope: str


class FeedServer:
    """`with FeedServer() as v:` serves `v.items` at `v.url`; `v.identity` signs what `v.add` adds."""

    def __init__(self, identity: Identity | None = None, domain: str = DOMAIN) -> None:
        self.identity = identity or Identity.create()
        self.domain = domain
        self.items: list[Listed] = []
        self.once: list[Handler] = []  # answered one per request, before the normal listing
        self.requests: list[tuple[int, int]] = []  # (after, limit) of every request
        self.served: list[str] = []  # the JSON of every normal listing page served, in order
        self._nonce = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return self.identity.address

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seal(self, item: FeedItem, *, signer: Identity | None = None, domain: str | None = None) -> str:
        self._nonce += 1
        env = seal(signer or self.identity, item, domain=domain or self.domain, nonce=self._nonce)
        return env.to_bytes().decode()

    def add(self, item: FeedItem, *, envelope: str | None = None, work_key: str | None = None) -> int:
        """List `item` (sealed by this server's key unless `envelope` is given); returns its seq."""
        seq = len(self.items) + 1
        self.items.append(Listed(seq, work_key or to_hex(item.work_key), envelope or self.seal(item)))
        return seq

    def add_tampered(self, item: FeedItem) -> int:
        """Sealed properly, then one reward changed: still canonical bytes, no longer what was signed."""
        env = json.loads(self.seal(item))
        env["body"]["groups"][0]["samples"][0]["reward"] = 123.0
        return self.add(item, envelope=canonical_bytes(env).decode())

    async def _feed(self, request: web.Request) -> web.StreamResponse:
        after, limit = int(request.query.get("after", "0")), int(request.query.get("limit", "64"))
        self.requests.append((after, limit))
        if self.once:
            return await self.once.pop(0)(request)
        page = [i for i in self.items if i.seq > after][:limit]
        body = json.dumps(self.page(after, page))
        self.served.append(body)
        return web.Response(text=body, content_type="application/json")

    def page(self, after: int, items: list[Listed], *, signer: Identity | None = None,
             signed: list[Listed] | None = None, signed_after: int | None = None) -> dict[str, object]:
        """A listing page as the validator serves it, its `FeedPage` signed by `signer` (default: this server's
        key) over `signed` (default: `items`) and `signed_after` (default: `after`)."""
        listing = FeedPage(after=after if signed_after is None else signed_after, entries=tuple(
            FeedEntry(seq=i.seq, work_key=bytes.fromhex(i.work_key[2:]), item_hash=feed_item_hash(i.envelope.encode()))
            for i in (items if signed is None else signed)))
        self._nonce += 1
        return {
            "validator": self.address, "domain": self.domain,
            "items": [{"seq": i.seq, "work_key": i.work_key, "envelope": i.envelope} for i in items],
            "next": items[-1].seq if items else after,
            "listing": seal(signer or self.identity, listing, domain=self.domain, nonce=self._nonce).to_bytes().decode(),
        }

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/feed", self._feed)
        self._runner, self.port = await start_site(app, access_log=None)

    def __enter__(self) -> FeedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def oversize_declared(request: web.Request) -> web.StreamResponse:
    """A response whose Content-Length alone is over any test limit."""
    return web.Response(body=b"[" + b"0," * 50_000 + b"0]", content_type="application/json")


async def oversize_streamed(request: web.Request) -> web.StreamResponse:
    """A chunked response (no Content-Length) that goes on past any test limit."""
    resp = web.StreamResponse(headers={"content-type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    try:
        for _ in range(200):
            await resp.write(b" " * 4096)
        await resp.write_eof()
    except (ConnectionResetError, RuntimeError):  # the reader gave up, as it should
        pass
    return resp


def raw(body: bytes, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, status=status, content_type="application/json")

    return handler


@contextmanager
def briefly(source: Any, wait_timeout_s: float = 1.0) -> Iterator[None]:
    """`source` (a `ValidatorFeedSource`) gives up after `wait_timeout_s` inside the block: a test's expected
    starvation is quick, while the batches it expects to fill keep the long wait a busy machine may need."""
    kept, source.wait_timeout_s = source.wait_timeout_s, wait_timeout_s
    try:
        yield
    finally:
        source.wait_timeout_s = kept
