"""An HTTP request with a total deadline: a peer that hangs is a dead peer after its timeout.

httpx's timeouts bound each connect, write and read on its own, so a peer that accepts and then answers a
byte just inside the read timeout would hold a caller forever. Every role that asks a peer it does not
control (a node its validators, a validator its peers) reads through `bounded_request`: connect to last byte
within `timeout_s`, at most `max_bytes` read (issue 26 item 3).

With a plain `httpx.Client` the deadline is checked between body chunks only: a peer that trickles its status line
and headers (a byte every few seconds) still holds the caller until they are complete. A client from
`deadline_client` closes that gap: its sockets cap every connect, read and write at the time left before the
deadline of the `bounded_request` in progress, so the whole exchange, headers included, ends by then.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

from protocol.errors import PrimeError


class PeerTimeoutError(PrimeError):
    """The peer did not give a complete answer within the deadline (hung, stopped, or trickling bytes)."""

    code = "peer_timeout"


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("prime_request_deadline", default=None)
"""The monotonic deadline of the `bounded_request` running in this thread (None outside one)."""


def _left(timeout: float | None) -> float | None:
    """`timeout` capped at the time left before this thread's request deadline; ReadTimeout once it is past."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout("past the request's deadline")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _left(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _DeadlineTransport(httpx.HTTPTransport):
    """httpx's own transport over a connection pool whose sockets honour `_DEADLINE` (httpx offers no public
    way to choose the pool's network backend: its `_pool` is replaced; tests/unit/protocol/test_deadline.py
    fails if a new httpx stops using it)."""

    def __init__(self, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self._pool = httpcore.ConnectionPool(
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_DeadlineBackend())


def deadline_client(timeout_s: float, limits: httpx.Limits | None = None) -> httpx.Client:
    """An `httpx.Client` (plain HTTP) whose `bounded_request`s end at their deadline whatever the peer sends,
    a trickled status line and headers included; outside `bounded_request` it behaves like any client."""
    limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
    return httpx.Client(timeout=timeout_s, transport=_DeadlineTransport(limits))


@contextlib.contextmanager
def request_deadline(timeout_s: float) -> Iterator[float]:
    """Inside this block (this thread), a `deadline_client`'s sockets give up `timeout_s` from now: connect,
    status line, headers and body. Yields the monotonic deadline. For a caller that reads the response itself;
    `bounded_request` is one."""
    deadline = time.monotonic() + timeout_s
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def bounded_request(http: httpx.Client, method: str, url: str, timeout_s: float, *, max_bytes: int = 4 << 20,
                    **kw: Any) -> httpx.Response:
    """`method url` answered in full within `timeout_s`; `PeerTimeoutError` past it, `httpx.HTTPError`
    for other failures (a body over `max_bytes` is a `httpx.DecodingError`). With a `deadline_client` the
    status line and headers are inside the deadline too."""
    with request_deadline(timeout_s) as deadline:
        return _bounded(http, method, url, timeout_s, deadline, max_bytes, **kw)


def _bounded(http: httpx.Client, method: str, url: str, timeout_s: float, deadline: float, max_bytes: int,
             **kw: Any) -> httpx.Response:
    try:
        with http.stream(method, url, timeout=timeout_s, **kw) as r:
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"no complete answer from {url} within {timeout_s:g} s")
                if len(body) > max_bytes:
                    raise httpx.DecodingError(f"answer from {url} over {max_bytes} bytes")
            return httpx.Response(r.status_code, headers=r.headers, content=bytes(body), request=r.request)
    except httpx.TimeoutException as exc:
        raise PeerTimeoutError(f"{type(exc).__name__}: no answer from {url} within {timeout_s:g} s") from exc
