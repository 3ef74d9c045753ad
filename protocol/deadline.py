"""An HTTP request with a total deadline: a peer that hangs is a dead peer after its timeout.

httpx's timeouts bound each connect, write and read on its own, so a peer that accepts and then answers a
byte just inside the read timeout would hold a caller forever. Every role that asks a peer it does not
control (a node its validators, a validator its peers) reads through `bounded_request`: connect to last byte
within `timeout_s`, at most `max_bytes` read (issue 26 item 3).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from protocol.errors import PrimeError


class PeerTimeoutError(PrimeError):
    """The peer did not give a complete answer within the deadline (hung, stopped, or trickling bytes)."""

    code = "peer_timeout"


def bounded_request(http: httpx.Client, method: str, url: str, timeout_s: float, *, max_bytes: int = 4 << 20,
                    **kw: Any) -> httpx.Response:
    """`method url` answered in full within `timeout_s`; `PeerTimeoutError` past it, `httpx.HTTPError`
    for other failures (a body over `max_bytes` is a `httpx.DecodingError`)."""
    deadline = time.monotonic() + timeout_s
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
