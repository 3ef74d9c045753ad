"""The gate before a body is read, on a real validator on 127.0.0.1 against anvil (issue 35 items 1 and 2):
appeals need a signed upload header of a key the pool knows and take few slots; a full audit without the
operator's token is a cached report; `/v1/info` and `/health` answer while every worker thread is stuck; a
peer whose intake cannot take a staked upload counts as down."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from chainfixtures import VALIDATOR, VALIDATOR2

from protocol.identity import Identity
from protocol.upload import upload_headers
from validator.peers import PeerWatch

pytestmark = pytest.mark.timeout(240)

FAST = {"rate_per_node": 1000.0, "rate_burst": 1000}


def _open_upload(url: str, path: str, size: int, headers: dict[str, str]) -> socket.socket:
    """A POST to `path` that announces `size` body bytes, sends one, then nothing."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n{extra}\r\n{{".encode())
    return s


def _status(s: socket.socket) -> int:
    """The status code the server answered on `s` (it closes after a refusal)."""
    data = b""
    while b"\r\n" not in data and (chunk := s.recv(4096)):
        data += chunk
    s.close()
    return int(data.split(b" ", 2)[1])


def _answered(s: socket.socket) -> bytes | None:
    """What the server has answered on `s` so far without waiting: None while it still reads the body, b"" once
    it closed without a word."""
    s.setblocking(False)
    try:
        return s.recv(4096)
    except BlockingIOError:
        return None
    finally:
        s.setblocking(True)


def _signed(v: Any, who: Identity, body: bytes, path: str) -> dict[str, str]:
    return upload_headers(who, body, domain=v.service.domain, validator=v.service.identity.address, path=path)


def test_appeals_are_signed_before_their_body_and_take_few_slots(make_validator, make_node):
    """Issue 35 item 2: `/v1/appeals` read up to 16 MiB per request from anyone, with no cap, before any
    signature. Now: no header 401 and an unregistered key 403 before the body; `appeals.max_concurrent` slow
    uploads of registered keys hold every appeal slot and the next is answered 503 at once (never read)."""
    v = make_validator(appeals={"max_concurrent": 2}, gate={"read_grace_s": 120.0})
    big = 16 << 20
    with v.client() as c:
        r = c.post("/v1/appeals", content=b"{}")
        assert (r.status_code, r.json()["error"]) == (401, "upload_header_required"), r.text
        stranger = Identity.create()
        r = c.post("/v1/appeals", content=b"{}", headers=_signed(v, stranger, b"{}", "/v1/appeals"))
        assert (r.status_code, r.json()["error"]) == (403, "no_standing"), r.text
    nodes = [make_node() for _ in range(3)]
    deadline = time.monotonic() + 60
    while not all(v.service.chain.known(n.identity.address) for n in nodes):  # the chain view's poll
        assert time.monotonic() < deadline
        time.sleep(0.05)
    held = [_open_upload(v.url, "/v1/appeals", big, _signed(v, n.identity, b"x" * big, "/v1/appeals"))
            for n in nodes[:2]]
    with v.client() as c:
        while True:  # both slow appeals hold a slot once their headers are read; until then a small one is read
            r = c.post("/v1/appeals", content=b"{}", headers=_signed(v, nodes[2].identity, b"{}", "/v1/appeals"))
            if r.status_code == 503:
                break
            assert r.status_code == 400 and time.monotonic() < deadline, r.text
            time.sleep(0.05)
        assert r.json()["error"] == "overloaded" and r.headers["Retry-After"] == "1"
    for s in held:
        s.close()
    # an oversized declaration is refused from its headers
    over = _open_upload(v.url, "/v1/appeals", big + 1, _signed(v, nodes[2].identity, b"", "/v1/appeals"))
    assert _status(over) == 413


def test_a_full_audit_without_the_token_is_a_cached_report(make_validator, make_node, monkeypatch):
    """Issue 35 item 2: `/v1/audit` scanned the whole ledger for anyone. Now a full audit without the operator's
    token is the report of at most one scan per `audit_cache_s`; the operator's token scans afresh."""
    monkeypatch.setenv("PRIME_TEST_AUDIT_TOKEN", "s3cret")
    node = make_node()
    v = make_validator(**FAST, audit_cache_s=3600.0, audit_token_env="PRIME_TEST_AUDIT_TOKEN",
                       flood={"hold_slashable": False})
    sub, _ = node.build(counter=0, cheat="unassigned_task")
    datas = [node.seal(sub.model_copy(update={"counter": i})) for i in range(2)]
    operator = {"Authorization": "Bearer s3cret"}
    with v.client() as c:
        assert c.post("/v1/submissions", content=datas[0]).status_code == 200
        first = c.get("/v1/audit").json()
        assert first["counts"]["received"] == 1
        assert c.post("/v1/submissions", content=datas[1]).status_code == 200
        cached = c.get("/v1/audit", headers={"Authorization": "Bearer wrong"}).json()
        assert cached["counts"]["received"] == 1 and cached["age_s"] > 0  # the same scan, not a new one
        assert c.get("/v1/audit", headers=operator).json()["counts"]["received"] == 2
        assert c.get("/v1/audit?rows=false").json()["counts"]["received"] == 2  # running tallies, no scan


def test_full_audits_are_rate_limited_per_address_but_never_the_operators_or_the_counts(make_validator, make_node,
                                                                                         monkeypatch):
    """Issue 35 item 2: a cached report still cost the event loop an encoding per request (~890 a second from 200
    loops in the hostile run). Now the report is encoded once per scan, and one address gets
    `audit_burst_per_address` full audits, then `audit_rate_per_address` a second (429 + Retry-After, held up to
    its wait so a closed loop cannot spin on refusals); the operator's token and `?rows=false` are never limited,
    and another address has its own bucket."""
    monkeypatch.setenv("PRIME_TEST_AUDIT_TOKEN", "s3cret")
    node = make_node()
    v = make_validator(**FAST, audit_cache_s=3600.0, audit_token_env="PRIME_TEST_AUDIT_TOKEN",
                       audit_rate_per_address=0.001, audit_burst_per_address=2, flood={"hold_slashable": False})
    sub, _ = node.build(counter=0, cheat="unassigned_task")
    operator = {"Authorization": "Bearer s3cret"}
    with v.client() as c:
        assert c.post("/v1/submissions", content=node.seal(sub)).status_code == 200
        fresh = c.get("/v1/audit", headers=operator).json()  # scans, and caches what it scanned
        first, second = c.get("/v1/audit"), c.get("/v1/audit")
        assert first.status_code == second.status_code == 200
        cached = first.json()
        assert cached.pop("age_s") >= 0 and fresh.pop("age_s") == 0
        assert cached == fresh  # the spliced bytes are the report, with who answered
        assert cached["validator"] == v.service.identity.address and cached["counts"]["received"] == 1
        over = c.get("/v1/audit")
        assert over.status_code == 429 and over.json()["error"] == "rate_limited"
        assert int(over.headers["retry-after"]) >= 1
        assert c.get("/v1/audit", headers=operator).status_code == 200
        counts = c.get("/v1/audit?rows=false")
        assert counts.status_code == 200 and counts.json()["counts"]["received"] == 1
    other = httpx.Client(base_url=v.url, timeout=30.0, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with other:
        assert other.get("/v1/audit").status_code == 200  # its own bucket
    assert v.service.core.stats.get("audit_rate_limited") == 1
    assert v.service.core.stats.get("audit_held") == 1  # answered after its wait (at most 1 s), not at once


def test_info_and_health_answer_while_every_worker_thread_waits(make_validator, make_node):
    """Issue 35 item 2: `/v1/info` and `/health` never wait on the thread pool or a lock. The chain view's lock is
    held (as a slow refresh could) while 60 requests that need it fill every worker thread."""
    v = make_validator()
    node = make_node().identity.address
    lock = v.service.chain._lock  # what a stuck chain view holds
    with ThreadPoolExecutor(60) as pool:
        with lock:
            stuck = [pool.submit(httpx.get, f"{v.url}/v1/nodes/{node}", timeout=120) for _ in range(60)]
            time.sleep(0.5)  # not a timing assertion: the requests above only need to have been sent
            with httpx.Client(base_url=v.url, timeout=10) as quick:
                assert quick.get("/health").json() == {"status": "ok"}
                info = quick.get("/v1/info")
                assert info.status_code == 200 and info.json()["validator"] == v.service.identity.address
            assert not all(f.done() for f in stuck)  # they were still waiting on the lock
        assert all(f.result().status_code == 200 for f in stuck)


def test_a_peer_whose_intake_is_full_counts_as_down(make_validator, make_node, published):
    """Issue 35 item 1: the second validator never took over while slow uploads held the first one's intake,
    because its probe asked only `/v1/info`. Now the probe takes an intake slot with a signed upload header."""
    me, peer = published.chain.account(VALIDATOR), published.chain.account(VALIDATOR2)
    v = make_validator(validators=[me.address, peer.address], flood={"max_concurrent": 1},
                       gate={"read_grace_s": 120.0})
    greedy = make_node()
    v.service.chain.refresh()  # the validator knows the node before its upload (no catch-up timing in the test)
    assert v.service.chain.node_active(greedy.identity.address)
    watch = PeerWatch([v.url], identity=peer, domain=v.service.domain, failover_after_s=0.01)

    def hold() -> socket.socket:
        return _open_upload(v.url, "/v1/submissions", 4000,
                            _signed(v, greedy.identity, b"x" * 4000, "/v1/submissions"))

    try:
        watch.probe()
        assert not watch.down(me.address) and watch.urls() == {me.address: v.url}
        held, refused = hold(), []
        deadline = time.monotonic() + 60
        while not watch.down(me.address):  # the one slot is held: the probe is refused
            assert time.monotonic() < deadline, (watch.peers[0].error, refused, v.service.core.stats.snapshot())
            if (answer := _answered(held)) is not None:
                # a probe held the one slot when the upload came (503): the upload holds it once a probe does not
                refused.append(answer[:40])
                held.close()
                held = hold()
            watch.probe()
            time.sleep(0.05)
        assert "503" in watch.peers[0].error
        held.close()
        while watch.down(me.address):
            assert time.monotonic() < deadline, watch.peers[0].error
            watch.probe()
            time.sleep(0.05)
    finally:
        watch.close()


def _idle(url: str, source: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=60, source_address=(source, 0))


def _closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (read until EOF; the server never answers a connection with no request)."""
    try:
        return s.recv(1) == b""
    finally:
        s.close()


def test_idle_connections_are_capped_per_address_and_in_all(make_validator):
    """Issue 35 item 1 (server limits): connections that never send a request hold at most
    `max_connections_per_address` each address, and past `max_connections` a new one closes the oldest still
    waiting for its headers, so a request that sends its headers at once is always served."""
    v = make_validator(gate={"max_connections_per_address": 3, "max_connections": 6, "header_timeout_s": 120.0})
    first = [_idle(v.url, "127.0.0.2") for _ in range(3)]
    assert _closed(_idle(v.url, "127.0.0.2"))  # a fourth from that address: closed at once
    more = [_idle(v.url, "127.0.0.3") for _ in range(3)]  # six open: the cap in all
    with httpx.Client(base_url=v.url, timeout=30) as c:  # one more connection: the oldest idle one makes room
        assert c.get("/health").status_code == 200
    assert _closed(first[0])
    stats = v.service.core.stats.snapshot()
    assert stats["refused_connections_per_address"] == 1 and stats["evicted_waiting_connections"] >= 1, stats
    for s in first[1:] + more:
        s.close()
