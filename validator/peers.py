"""The other validators of the run, as seen from here: their addresses, URLs, and whether they answer.

Work is assigned by rendezvous ranking over the announced validator set. When the first-ranked
validator is down, the next one takes the node's work, but only if *it* cannot reach the first one
either, for at least `failover_after_s`: a node cannot shop for another validator by claiming its
assigned one is down. A validator whose URL is unknown here is taken to be up (no failover for it). A peer that accepts and
never answers (a stopped process), or trickles bytes, fails its probe at `timeout_s` (a total deadline) and
counts as down like a dead one.

A probe asks `/v1/info` (the peer's address) and then its intake: `POST /v1/intake/probe` with this validator's
signed upload header and an empty body takes a slot of the same pool a staked node's submission takes, so a
peer whose intake is full or whose backlog has no room (503), however well its `/v1/info` answers, counts as
down too, and its nodes' work comes here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from protocol.deadline import bounded_request, deadline_client
from protocol.identity import Identity, checksum
from protocol.upload import upload_headers

log = logging.getLogger(__name__)

PROBE_PATH = "/v1/intake/probe"


@dataclass
class PeerState:
    url: str
    address: str | None = None
    last_ok: float | None = None
    failing_since: float | None = None
    error: str = ""


class PeerWatch:
    """Probes each peer's `/v1/info` and intake every `probe()` call (a service loop calls it)."""

    def __init__(self, urls: list[str], *, identity: Identity, domain: str, failover_after_s: float,
                 timeout_s: float = 3.0) -> None:
        self.identity, self.domain = identity, domain
        self.me = checksum(identity.address)
        self.failover_after_s = failover_after_s
        self.peers = [PeerState(u.rstrip("/")) for u in urls]
        self.timeout_s = timeout_s
        self._http = deadline_client(timeout_s)  # headers trickled by a peer end at the deadline too
        self._lock = threading.Lock()

    def probe(self) -> None:
        for peer in self.peers:
            now = time.monotonic()
            try:
                r = bounded_request(self._http, "GET", peer.url + "/v1/info", self.timeout_s)
                r.raise_for_status()
                address = checksum(str(r.json()["validator"]))
                with self._lock:
                    peer.address = address  # known by its info: a peer whose intake is full from the start is down
                headers = upload_headers(self.identity, b"", domain=self.domain, validator=address, path=PROBE_PATH)
                r = bounded_request(self._http, "POST", peer.url + PROBE_PATH, self.timeout_s, content=b"",
                                    headers=headers)
                if r.status_code != 200:
                    raise RuntimeError(f"intake refuses a staked upload: HTTP {r.status_code} {r.text[:120]}")
            except Exception as exc:  # noqa: BLE001 - any failure is "not answering", recorded
                with self._lock:
                    if peer.failing_since is None:
                        peer.failing_since = now
                        log.warning("peer validator %s stopped answering: %s", peer.url, exc)
                    peer.error = f"{type(exc).__name__}: {exc}"[:200]
                continue
            with self._lock:
                if peer.failing_since is not None:
                    log.info("peer validator %s answers again", peer.url)
                peer.address, peer.last_ok, peer.failing_since, peer.error = address, now, None, ""

    def down(self, address: str) -> bool:
        """True once every known URL of `address` has failed for at least `failover_after_s`."""
        address = checksum(address)
        now = time.monotonic()
        with self._lock:
            mine = [p for p in self.peers if p.address == address]
            return bool(mine) and all(
                p.failing_since is not None and now - p.failing_since >= self.failover_after_s for p in mine)

    def urls(self) -> dict[str, str]:
        """{address: url} of the peers identified so far (served in /v1/info so nodes can fail over)."""
        with self._lock:
            return {p.address: p.url for p in self.peers if p.address is not None and p.address != self.me}

    def close(self) -> None:
        self._http.close()
