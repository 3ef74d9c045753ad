"""Loopback helpers shared by test tiers (importable from any test: `tests/` is on sys.path via its
conftest): a free TCP port, a wait for an HTTP endpoint to answer, an ASGI app served in a thread and a look-alike's
proxied `/v1/info` and a TCP proxy process (these five are `bench.loopback`'s, which the benchmarks use too), and a
server that hangs."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from bench.loopback import ProxyProcess, forward_info, free_port, serve_asgi, wait_http

__all__ = ["ProxyProcess", "forward_info", "free_port", "hung_server", "serve_asgi", "wait_http"]


@contextlib.contextmanager
def hung_server(trickle_s: float | None = None, head_first: bool = False,
                heard: list[str] | None = None) -> Iterator[str]:
    """A loopback peer that accepts connections and never answers (a `SIGSTOP`ped process, a wedged proxy):
    with `trickle_s`, it answers one byte of an endless HTTP response every `trickle_s` seconds instead
    ("a byte a minute"); with `head_first` too, the status line and headers come at once and only the body
    trickles. With `heard`, the request line of each request is appended to it ("POST /v1/submissions") once
    its head is in. Yields its base URL; closes every connection on exit."""
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

    def listen(conn: socket.socket) -> None:
        data = b""
        conn.settimeout(0.1)
        while b"\r\n\r\n" not in data and not stop.is_set():
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not chunk:
                return
            data += chunk
        if heard is not None and b"\r\n\r\n" in data:
            heard.append(" ".join(data.split(b"\r\n", 1)[0].decode(errors="replace").split(" ")[:2]))

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            if heard is not None:
                threading.Thread(target=listen, args=(conn,), daemon=True).start()
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
