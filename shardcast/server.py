"""The HTTP face of an origin or relay: version index (long-poll), manifests, shards, health, metrics.

    GET      /versions?after=N&wait=S    index; with `wait`, answers as soon as a version > N appears
    GET      /v/{version}/manifest       the signed manifest (bytes as signed)
    GET|HEAD /v/{version}/shards/{i}     shard bytes, Range supported (sendfile on worker threads); while a relay is still
                                         fetching shard i it holds the request until the shard is verified
                                         (pipelining) and answers 503 + Retry-After if that takes too long
    GET      /health, /metrics           liveness and Prometheus text format

Only integers reach the file system (routes match `\\d+`), so there is no path to traverse. Request
lines and headers are size-limited by aiohttp's parser settings, bodies by `client_max_size`, and
concurrent transfers by a semaphore (further requests queue); every response streams from disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from shardcast.sendfile import send_file
from shardcast.store import Store

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 4096
MAX_HEADER_FIELD = 8192
MAX_BODY = 1024  # no endpoint takes a body


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
    ) -> None:
        self.store = store
        self.role = role
        self.host = host
        self.port = port
        self.shard_wait_s = shard_wait_s
        self.max_poll_s = max_poll_s
        self.metrics = ServerMetrics(role)
        self.started_at = time.time()
        self._transfers = asyncio.Semaphore(max_transfers)
        # Bodies leave through sendfile on these threads, so serving uses more than the loop's core.
        self._sendfile_pool = ThreadPoolExecutor(max_workers=sendfile_threads, thread_name_prefix="shardcast-send")
        self._runner: web.AppRunner | None = None

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
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app(), access_log=None, max_line_size=MAX_REQUEST_LINE, max_field_size=MAX_HEADER_FIELD,
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024, reuse_address=True)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        log.info("%s serving %s on %s", self.role, self.store.root, self.url)

    async def stop(self) -> None:
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
        async with self._transfers:
            response = await send_file(request, state.shard_path(index), self._sendfile_pool,
                                       extra_headers={"Cache-Control": "public, max-age=31536000, immutable"})
            if response.content_length and request.method == "GET":
                self.metrics.bytes_served.inc(response.content_length)
        return response
