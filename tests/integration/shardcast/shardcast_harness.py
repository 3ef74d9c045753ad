"""Loopback helpers for the SHARDCAST integration tests: ports, a throttling TCP proxy,
and relay subprocesses (that a test can SIGKILL). Checkpoints of random bytes are `bench.loopback`'s, the relay
that serves whatever it is handed is `bench.adversaries.FakeRelay` (the attack bench uses both)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from netfixtures import free_port

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[3]


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run an async test body with a hard timeout (so a hang fails instead of blocking the suite)."""
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def connect_from(address: str, port: int, *, rcvbuf: int | None = None) -> socket.socket:
    """A blocking TCP connection to 127.0.0.1:`port` from the loopback `address` (127.0.0.2, ...: another
    peer as far as a server can tell), optionally with a small receive buffer (a slow reader)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed (or reset) `sock`: reads and discards whatever is still buffered."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(1 << 20):
                return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 30.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(interval)


async def index_of(url: str) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/versions", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return dict(await r.json())
    except (aiohttp.ClientError, TimeoutError):
        return None


async def holds_complete(url: str, version: int) -> bool:
    index = await index_of(url)
    return index is not None and any(v["version"] == version and v["complete"] for v in index["versions"])


class ThrottleProxy:
    """A TCP proxy on loopback that forwards server->client bytes at `rate` bytes/s (so a test can
    interrupt a transfer half-way), each read `latency` seconds late (a far-away server); counts the
    bytes it forwarded."""

    def __init__(self, target_port: int, rate: float, latency: float = 0.0) -> None:
        self.target_port = target_port
        self.rate = rate
        self.latency = latency
        self.forwarded = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for w in list(self._writers):
            w.close()
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        # A small receive buffer so that what the upstream has "sent" is mostly still in its own
        # process when it dies (loopback buffers would otherwise hold whole shards).
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.target_port))
            up_reader, up_writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            writer.close()
            return
        self._writers.add(up_writer)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, throttle: bool) -> None:
            try:
                while data := await src.read(16384):
                    if throttle and self.latency:
                        await asyncio.sleep(self.latency)
                    dst.write(data)
                    await dst.drain()
                    if throttle:
                        self.forwarded += len(data)
                        await asyncio.sleep(len(data) / self.rate)
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True))


class RelayProcess:
    """`prime-relay relay` in a subprocess (python -m shardcast.cli), so a test can SIGKILL it."""

    def __init__(self, upstreams: list[str], trainer: str, store: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardcast.cli", "--log-level", "WARNING", "relay", "--upstream", *upstreams,
             "--trainer", trainer, "--store", str(store), "--port", str(self.port)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
