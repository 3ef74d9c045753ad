"""Loopback helpers shared by test tiers (importable from any test: `tests/` is on sys.path via its
conftest): a free TCP port and a wait for an HTTP endpoint to answer."""

from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it; another process may still
    take it before the caller binds, so callers that can should bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60.0, alive: object = None) -> httpx.Response:
    """GET `url` until it answers 200; AssertionError after `timeout` seconds, or at once when `alive`
    (a `subprocess.Popen`) has exited."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        poll = getattr(alive, "poll", None)
        if poll is not None and poll() is not None:
            raise AssertionError(f"process exited with {poll()} before {url} answered")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return r
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout} s (last: {last!r})")
