"""Loopback helpers shared by test tiers (importable from any test: `tests/` is on sys.path via its
conftest): a free TCP port, a wait for an HTTP endpoint to answer, an ASGI app served in a thread and a look-alike's
proxied `/v1/info` (these four are `bench.loopback`'s, which the benchmarks use too), a server that hangs, and a TCP
proxy process."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from bench.loopback import forward_info, free_port, serve_asgi, wait_http

__all__ = ["ProxyProcess", "forward_info", "free_port", "hung_server", "serve_asgi", "wait_http"]


@contextlib.contextmanager
def hung_server(trickle_s: float | None = None, head_first: bool = False) -> Iterator[str]:
    """A loopback peer that accepts connections and never answers (a `SIGSTOP`ped process, a wedged proxy):
    with `trickle_s`, it answers one byte of an endless HTTP response every `trickle_s` seconds instead
    ("a byte a minute"); with `head_first` too, the status line and headers come at once and only the body
    trickles. Yields its base URL; closes every connection on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def trickle(conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"
        data = head + b"{" + b" " * 1_000_000
        if head_first:
            try:
                conn.sendall(head)
            except OSError:
                return
            data = data[len(head):]
        for i in range(len(data)):
            if stop.wait(trickle_s):
                return
            try:
                conn.sendall(data[i : i + 1])
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            if trickle_s is not None:
                threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for c in [listener, *conns]:
            with contextlib.suppress(OSError):
                c.close()


_PROXY = """
import asyncio, sys
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    finally:
        w.close()
async def handle(r, w):
    ur, uw = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


class ProxyProcess:
    """A TCP forwarder to 127.0.0.1:`target_port` in its own process, so a test can `SIGSTOP` it: the peer
    behind it then accepts connections (the kernel's backlog) and never answers, exactly as a stopped role
    does, while the role itself keeps running in the test's process."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        """`port`: listen there (a proxy started again where a killed one listened), else on a free port."""
        import subprocess
        import sys

        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", _PROXY, str(self.port), str(target_port)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def close(self) -> None:
        import signal

        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
