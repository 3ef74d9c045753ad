"""A peer that accepts and never answers, or answers a byte at a time, fails a bounded request at its
deadline instead of holding the caller (issue 26 item 3)."""

from __future__ import annotations

import httpx
import pytest
from netfixtures import hung_server, serve_asgi

from protocol.deadline import PeerTimeoutError, bounded_request, deadline_client

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("trickle_s", [None, 0.2])
def test_a_hung_or_trickling_peer_times_out(trickle_s: float | None) -> None:
    # a byte every 0.2 s never trips httpx's per-read timeout of 1 s: only a total deadline ends it
    with hung_server(trickle_s) as url, httpx.Client() as http, pytest.raises(PeerTimeoutError):
        bounded_request(http, "GET", url + "/v1/info", 1.0)


@pytest.mark.timeout(30)
def test_a_deadline_client_ends_trickled_headers_at_the_deadline() -> None:
    # the status line and headers a byte every 1.5 s, inside httpx's per-read timeout of 2 s: a plain client
    # waits ~80 s for them before it has a response to check the deadline against; a deadline_client's
    # sockets give up when the deadline passes
    with hung_server(1.5) as url, deadline_client(2.0) as http, pytest.raises(PeerTimeoutError):
        bounded_request(http, "GET", url + "/v1/info", 2.0)


def test_a_deadline_client_answers_like_any_client() -> None:
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/info")
    def info() -> dict[str, bool]:
        return {"ok": True}

    with serve_asgi(app) as url, deadline_client(5.0) as http:
        assert bounded_request(http, "GET", url + "/v1/info", 5.0).json() == {"ok": True}
        assert http.get(url + "/v1/info").json() == {"ok": True}  # outside a bounded request: no deadline
        assert bounded_request(http, "GET", url + "/v1/info", 5.0).json() == {"ok": True}  # a kept-alive socket


def test_node_directory_skips_a_hung_validator() -> None:
    """`ValidatorDirectory.refresh` asks each URL's /v1/info within its own deadline: a hung one is reported
    unavailable, not waited on (the node then fails over; see tests/integration/node/test_node_failover.py)."""
    from node.worker import ValidatorDirectory

    with hung_server(0.2) as url, httpx.Client(timeout=1.0) as http:
        directory = ValidatorDirectory([url], http, lambda _a: True, timeout_s=1.0)
        directory.refresh()
        assert directory.announced == [] and directory.url_of("0x" + "00" * 20) is None
