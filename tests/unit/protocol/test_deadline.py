"""A peer that accepts and never answers, or answers a byte at a time, fails a bounded request at its
deadline instead of holding the caller (issue 26 item 3)."""

from __future__ import annotations

import httpx
import pytest
from netfixtures import hung_server

from protocol.deadline import PeerTimeoutError, bounded_request

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("trickle_s", [None, 0.2])
def test_a_hung_or_trickling_peer_times_out(trickle_s: float | None) -> None:
    # a byte every 0.2 s never trips httpx's per-read timeout of 1 s: only a total deadline ends it
    with hung_server(trickle_s) as url, httpx.Client() as http, pytest.raises(PeerTimeoutError):
        bounded_request(http, "GET", url + "/v1/info", 1.0)


def test_node_directory_skips_a_hung_validator() -> None:
    """`ValidatorDirectory.refresh` asks each URL's /v1/info within its own deadline: a hung one is reported
    unavailable, not waited on (the node then fails over; see tests/integration/node/test_node_failover.py)."""
    from node.worker import ValidatorDirectory

    with hung_server(0.2) as url, httpx.Client(timeout=1.0) as http:
        directory = ValidatorDirectory([url], http, lambda _a: True, timeout_s=1.0)
        directory.refresh()
        assert directory.announced == [] and directory.url_of("0x" + "00" * 20) is None
