"""The HTTP face of an origin or relay: version index (long-poll), manifests, shards, health, metrics.

    GET      /versions?after=N&wait=S    index; with `wait`, answers as soon as a version > N appears
    GET      /v/{version}/manifest       the signed manifest (bytes as signed)
    GET|HEAD /v/{version}/shards/{i}     shard bytes, Range supported (sendfile on worker threads); while a relay is still
                                         fetching shard i it holds the request until the shard is verified
                                         (pipelining) and answers 503 + Retry-After if that takes too long
    GET|HEAD /v/{version}/full/{i}       a delta version's full-weight shard i (`delta.shards`): an origin keeps them, a
                                         relay fetches one from its upstreams when first asked (`fetch_full`), verified,
                                         and answers 404 when none has it: the fallback of a client whose base chain
                                         nobody serves
    GET      /health, /metrics           liveness and Prometheus text format

Only integers reach the file system (routes match `\\d+`), so there is no path to traverse. Request
lines and headers are size-limited by aiohttp's parser settings, bodies by `client_max_size`, and
concurrent transfers by a semaphore (further requests queue); every response streams from disk.

What one peer can hold is bounded (`ServeLimits`): open connections per peer address (an IPv6 peer
counts per /64), a request head must be complete within `head_timeout_s` of the connection opening or
of its previous response, and a response body must keep up a minimum average rate
(`shardcast.sendfile.SendFloor`), so that a few dozen clients that ask for a large shard and then
read slowly or not at all cannot starve honest transfers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from shardcast.errors import RelayConfigError
from shardcast.sendfile import SendFloor, send_file
from shardcast.store import Store, VersionState

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 4096
MAX_HEADER_FIELD = 8192
MAX_BODY = 1024  # no endpoint takes a body


@dataclass(frozen=True)
class ServeLimits:
    """How much of a server one peer may hold, and for how long."""

    max_conns_per_peer: int = 128
    """Open connections per peer address (IPv6: per /64); more are answered 503 and closed at once.
    A pulling client uses about 10 (its shard workers plus the index), a relay about 6."""
    head_timeout_s: float = 20.0
    """A connection must deliver a complete request head within this many seconds of opening, or of
    its previous response (so idle keep-alive connections close after it too)."""
    min_send_rate: float = 16 * 1024
    """Bytes/s a shard response must average after `send_grace_s`, or the connection is cut."""
    send_grace_s: float = 20.0
    """Seconds a response may take before the rate floor applies."""

    def __post_init__(self) -> None:
        if self.max_conns_per_peer < 1 or self.head_timeout_s <= 0 or self.min_send_rate <= 0 or self.send_grace_s < 0:
            raise RelayConfigError(f"unusable serving limits: {self}")

    @property
    def floor(self) -> SendFloor:
        return SendFloor(min_rate=self.min_send_rate, grace_s=self.send_grace_s)


def peer_key(peername: Any) -> str:
    """The address a connection limit applies to: the IPv4 address, or the /64 of an IPv6 one."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
         b"Connection: close\r\n\r\n")


class _PeerGate:
    """Counts open connections per peer; wraps aiohttp's protocol factory and turns away the excess."""

    def __init__(self, factory: Any, cap: int, on_refused: Any) -> None:
        self.factory = factory
        self.cap = cap
        self.on_refused = on_refused
        self.open: dict[str, int] = {}

    def __call__(self) -> asyncio.Protocol:
        return _GatedProtocol(self)


class _GatedProtocol(asyncio.Protocol):
    """aiohttp's request handler behind a per-peer connection count (it sees every event unchanged)."""

    def __init__(self, gate: _PeerGate) -> None:
        self.gate = gate
        self.inner: asyncio.Protocol | None = None
        self.peer: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = peer_key(transport.get_extra_info("peername"))
        if self.gate.open.get(peer, 0) >= self.gate.cap:
            self.gate.on_refused(peer)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_BUSY)
            transport.close()
            return
        self.peer = peer
        self.gate.open[peer] = self.gate.open.get(peer, 0) + 1
        self.inner = self.gate.factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            left = self.gate.open.get(self.peer, 1) - 1
            if left > 0:
                self.gate.open[self.peer] = left
            else:
                self.gate.open.pop(self.peer, None)
            self.peer = None
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ServerMetrics:
    """Prometheus metrics of one server (own registry, so several servers can share a process)."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "shardcast_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.bytes_served = Counter("shardcast_bytes_served", "Shard bytes sent", registry=self.registry)
        self.pipelined_waits = Counter(
            "shardcast_pipelined_waits", "Shard requests that waited for the shard to arrive", registry=self.registry
        )
        self.latest = Gauge("shardcast_latest_version", "Newest version held", registry=self.registry)
        self.held = Gauge("shardcast_versions_held", "Versions held (retention)", registry=self.registry)
        self.shards_fetched = Counter(
            "shardcast_shards_fetched", "Shards fetched from upstream and verified", registry=self.registry
        )
        self.bad_shards = Counter(
            "shardcast_bad_shards", "Shards from upstream that failed verification", registry=self.registry
        )
        self.upstream_errors = Counter("shardcast_upstream_errors", "Failed upstream requests", registry=self.registry)
        self.slow_readers = Counter(
            "shardcast_slow_readers_cut", "Shard responses cut off for reading below the rate floor",
            registry=self.registry,
        )
        self.refused = Counter(
            "shardcast_connections_refused", "Connections refused: the peer held too many", registry=self.registry
        )
        self.info = Gauge("shardcast_role_info", "Role of this server", ["role"], registry=self.registry)
        self.info.labels(role=role).set(1)

    def count(self, endpoint: str, status: int) -> float:
        value = self.registry.get_sample_value("shardcast_requests_total", {"endpoint": endpoint, "status": str(status)})
        return value or 0.0


class ShardServer:
    """aiohttp server over a `Store`; `start()`/`stop()` or `async with`."""

    def __init__(
        self,
        store: Store,
        *,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        shard_wait_s: float = 30.0,
        max_poll_s: float = 60.0,
        max_transfers: int = 256,
        sendfile_threads: int = 16,
        limits: ServeLimits | None = None,
    ) -> None:
        self.store = store
        self.role = role
        self.host = host
        self.port = port
        self.shard_wait_s = shard_wait_s
        self.max_poll_s = max_poll_s
        self.metrics = ServerMetrics(role)
        self.limits = limits or ServeLimits()
        self.started_at = time.time()
        self._transfers = asyncio.Semaphore(max_transfers)
        # Bodies leave through sendfile on these threads, so serving uses more than the loop's core.
        self._sendfile_pool = ThreadPoolExecutor(max_workers=sendfile_threads, thread_name_prefix="shardcast-send")
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._gate: _PeerGate | None = None
        self.documents: dict[str, Callable[[], bytes]] = {}
        """Extra read-only JSON documents, path -> body maker (set before `start`), e.g. the entry point's
        `/v1/announcements` when discovery runs beside this server; the library itself knows none."""
        self.fetch_full: Callable[[VersionState, int], Awaitable[Path | None]] | None = None
        """Where a delta version's full-weight shard not kept here comes from (a relay: its upstreams, verified);
        None (an origin): nowhere."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.on_response_prepare.append(self._count)
        app.router.add_get("/health", self._health, name="health")
        app.router.add_get("/metrics", self._metrics, name="metrics")
        app.router.add_get("/versions", self._versions, name="versions")
        app.router.add_get(r"/v/{version:\d{1,12}}/manifest", self._manifest, name="manifest")
        app.router.add_get(r"/v/{version:\d{1,12}}/shards/{index:\d{1,9}}", self._shard, name="shard")
        app.router.add_get(r"/v/{version:\d{1,12}}/full/{index:\d{1,9}}", self._full_shard, name="full_shard")
        for path, make in self.documents.items():
            app.router.add_get(path, self._document(make))
        return app

    @staticmethod
    def _document(make: Callable[[], bytes]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def serve(_request: web.Request) -> web.Response:
            return web.Response(body=make(), content_type="application/json")
        return serve

    async def start(self) -> None:
        # aiohttp's keep-alive timer closes a connection that has no complete request `keepalive_timeout`
        # after it opened or after its last response: that is the request-head timeout.
        self._runner = web.AppRunner(
            self.app(), access_log=None, max_line_size=MAX_REQUEST_LINE, max_field_size=MAX_HEADER_FIELD,
            shutdown_timeout=1.0, keepalive_timeout=self.limits.head_timeout_s,
        )
        await self._runner.setup()
        assert self._runner.server is not None
        self._gate = _PeerGate(self._runner.server, self.limits.max_conns_per_peer, self._refused)
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self._gate, self.host, self.port, backlog=1024, reuse_address=True
            )
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise RelayConfigError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from exc
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s serving %s on %s", self.role, self.store.root, self.url)

    def _refused(self, peer: str) -> None:
        self.metrics.refused.inc()
        log.info("refusing a connection from %s: it holds %d already", peer, self.limits.max_conns_per_peer)

    def open_connections(self, peer: str) -> int:
        """Connections `peer` (an address as `peer_key` writes it) holds open now."""
        return self._gate.open.get(peer, 0) if self._gate is not None else 0

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting; the runner's cleanup closes the open connections
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._sendfile_pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> ShardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- handlers ----------------------------------------------------------------------------------

    async def _count(self, request: web.Request, response: web.StreamResponse) -> None:
        # Counted when the response is prepared, before its first byte leaves: a count taken after
        # the handler returns can lag a client that already holds every byte (sendfile runs on a thread).
        route = request.match_info.route
        endpoint = route.name if route is not None and route.name else "other"
        self.metrics.requests.labels(endpoint=endpoint, status=str(response.status)).inc()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "role": self.role, "latest": self.store.latest, "uptime_s": round(time.time() - self.started_at, 1)}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.latest.set(self.store.latest or 0)
        self.metrics.held.set(len(self.store.versions()))
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _versions(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "-1"))
            wait = float(request.query.get("wait", "0"))
        except ValueError as exc:
            raise web.HTTPBadRequest(text="after must be an integer, wait a number of seconds") from exc
        wait = max(0.0, min(wait, self.max_poll_s))
        deadline = time.monotonic() + wait
        while (self.store.latest is None or self.store.latest <= after) and time.monotonic() < deadline:
            await self.store.wait_change(deadline - time.monotonic())
        return web.json_response(self.store.index())

    async def _manifest(self, request: web.Request) -> web.Response:
        version = int(request.match_info["version"])
        state = self.store.get(version)
        if state is None:
            raise web.HTTPNotFound(text=f"version {version} not held here")
        return web.Response(body=state.raw, content_type="application/json")

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        version = int(request.match_info["version"])
        index = int(request.match_info["index"])
        state = self.store.get(version)
        if state is None:
            raise web.HTTPNotFound(text=f"version {version} not held here")
        if index >= len(state.manifest.shards):
            raise web.HTTPNotFound(text=f"version {version} has {len(state.manifest.shards)} shards")
        if index not in state.available:
            self.metrics.pipelined_waits.inc()
            if not await self.store.wait_shard(state, index, self.shard_wait_s):
                if self.store.get(version) is None:
                    raise web.HTTPNotFound(text=f"version {version} was dropped (retention)")
                raise web.HTTPServiceUnavailable(text="shard still arriving", headers={"Retry-After": "1"})
        return await self._send(request, state.shard_path(index))

    async def _full_shard(self, request: web.Request) -> web.StreamResponse:
        version = int(request.match_info["version"])
        state = self.store.get(version)
        index = int(request.match_info["index"])
        path = state.full_path(index) if state is not None else None
        if path is None and state is not None and self.fetch_full is not None and state.manifest.delta is not None \
                and index < len(state.manifest.delta.shards):
            path = await self.fetch_full(state, index)
        if path is None:
            raise web.HTTPNotFound(text=f"no full weights of version {version} here")
        return await self._send(request, path)

    async def _send(self, request: web.Request, path: Path) -> web.StreamResponse:
        async with self._transfers:
            sent = await send_file(request, path, self._sendfile_pool, floor=self.limits.floor,
                                   extra_headers={"Cache-Control": "public, max-age=31536000, immutable"})
        self.metrics.bytes_served.inc(sent.body_bytes)
        if sent.cut_slow:
            self.metrics.slow_readers.inc()
        return sent.response
