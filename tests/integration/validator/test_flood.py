"""Flood bounds of a real validator on 127.0.0.1 against anvil (issue 23 item 3): bytes stored per node per
window, a node with a slash coming is held until it lands, a global cap on the backlog, a global intake
rate, and (issue 35 item 1) the gate before a body is read: slow uploads from no key take none of a staked
node's slots. Every refusal says when to come back (Retry-After)."""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlparse

import pytest

from contracts.pool import WorkStatus
from protocol.identity import Identity
from protocol.upload import upload_headers

pytestmark = pytest.mark.timeout(240)

FAST = {"rate_per_node": 1000.0, "rate_burst": 1000}  # the per-node rate limit out of the way


def _cheap_failures(node: Any, n: int, start: int = 0) -> list[bytes]:
    """`n` distinct submissions of `node` that fail a cheap check (wrong tasks) at intake, one generation."""
    sub, _ = node.build(counter=start, cheat="unassigned_task")
    return [node.seal(sub.model_copy(update={"counter": start + i})) for i in range(n)]


def _rows(v: Any, node: str) -> int:
    with v.client() as c:
        verdicts = c.get(f"/v1/nodes/{node}").json()["verdicts"]
    return sum(n for by_reason in verdicts.values() for n in by_reason.values())


def test_bytes_stored_per_node_per_window_are_bounded(make_validator, make_node):
    flooder, other = make_node(), make_node()
    floods = _cheap_failures(flooder, 12)
    size = len(floods[0])
    quota = 3 * size + size // 2  # room for three
    # the hard verdicts stay in the outbox (a long systemic window): on a slow box the first one's slash could land
    # mid-flood and the flooder's later posts get 403 node_inactive instead of the quota's 429 (CI run 31)
    v = make_validator(**FAST, flood={"node_bytes_per_window": quota, "window_s": 3600, "hold_slashable": False},
                       systemic={"window_s": 60, "min_nodes": 100, "fraction": 1.0})
    answers = []
    with v.client() as c:
        for data in floods:
            answers.append(c.post("/v1/submissions", content=data))
        ok = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 429]
        assert len(ok) == 3 and len(refused) == len(floods) - 3, [(r.status_code, r.text[:80]) for r in answers]
        assert all(r.json()["error"] == "node_quota" and int(r.headers["Retry-After"]) >= 1 for r in refused)
        assert _rows(v, flooder.identity.address) == 3
        # another node's bytes are its own
        r = c.post("/v1/submissions", content=_cheap_failures(other, 1)[0])
        assert r.status_code == 200, r.text


def test_a_node_whose_slash_is_coming_is_held_until_it_lands(make_validator, make_node, published):
    flooder, other = make_node(), make_node()
    floods = _cheap_failures(flooder, 5)
    # the slash waits out 10 s: the next post is held (429) well inside it, however busy the box
    v = make_validator(**FAST, systemic={"window_s": 10.0, "min_nodes": 100, "fraction": 1.0})
    with v.client() as c:
        first = c.post("/v1/submissions", content=floods[0])
        assert first.status_code == 200 and first.json()["outcome"] == "rejected_hard"
        held = c.post("/v1/submissions", content=floods[1])  # the verdict waits out the systemic window
        assert held.status_code == 429 and held.json()["error"] == "node_quota", held.text
        assert int(held.headers["Retry-After"]) >= 1
        assert c.post("/v1/submissions", content=_cheap_failures(other, 1)[0]).status_code == 200
    v.wait_reported(first.json()["work_key"])  # the slash lands: the node is out of the pool
    assert published.admin.get_work(first.json()["work_key"]).status == WorkStatus.HARD_INVALIDATED
    deadline = time.monotonic() + 30
    with v.client() as c:
        while (r := c.post("/v1/submissions", content=floods[2])).status_code != 403:
            assert r.status_code in (429, 503) and time.monotonic() < deadline, r.text  # 503: chain_unavailable
            time.sleep(0.1)
    assert _rows(v, flooder.identity.address) == 1


def test_the_backlog_of_undecided_and_unreported_work_is_capped(make_validator, make_node):
    a, b = make_node(), make_node()
    floods = _cheap_failures(a, 6)
    # hard verdicts wait out a long systemic window (60 s: with the reporter's back-off it stays below the loopback
    # pool's invalidation window, or the validator refuses to start): they stay in the outbox for this test
    v = make_validator(**FAST, flood={"max_backlog": 4, "hold_slashable": False},
                       systemic={"window_s": 60, "min_nodes": 100, "fraction": 1.0})
    with v.client() as c:
        codes = [c.post("/v1/submissions", content=data).status_code for data in floods]
        assert codes == [200] * 4 + [503] * 2
        r = c.post("/v1/submissions", content=_cheap_failures(b, 1)[0])  # the cap is for everyone
        assert r.status_code == 503 and r.json()["error"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
        audit = c.get("/v1/audit").json()["counts"]
    assert audit["received"] == 4


def test_the_intake_rate_of_all_nodes_together_is_capped(make_validator, make_node):
    nodes = [make_node() for _ in range(3)]
    built = [_cheap_failures(n, 1)[0] for n in nodes]
    v = make_validator(**FAST, flood={"rate": 0.001, "burst": 2})
    with v.client() as c:
        answers = [c.post("/v1/submissions", content=data) for data in built]
    assert [r.status_code for r in answers] == [200, 200, 503]
    assert answers[2].json()["error"] == "overloaded" and int(answers[2].headers["Retry-After"]) >= 1


def _slow_upload(url: str, headers: dict[str, str] | None = None, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` that sends a submission's headers (and `headers`) and the first byte of its
    body, then nothing."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=60, source_address=(source, 0))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s.sendall(f"POST /v1/submissions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n{extra}\r\n{{".encode())
    return s


def _half_headers(url: str) -> socket.socket:
    """A connection that sends half a request line, then nothing (headers never complete)."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    s.sendall(b"POST /v1/submis")
    return s


def _answer(s: socket.socket) -> bytes:
    """What the server sent before it closed `s` (b"" when it closed without an answer)."""
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    s.close()
    return data


def test_slow_uploads_without_a_key_cannot_stop_a_staked_nodes_submission(make_validator, make_node):
    """Issue 35 item 1. 16 slow uploads from no key once held every intake slot (16) and an honest staked node got
    503 on every try: now uploads without an upload header share a small pool of their own (one per address),
    an unstaked key's signed header is refused before its body, trickled headers are cut, a lagging body is cut
    (408), and the staked node's signed submission takes a slot of its own and is accepted during the attack."""
    honest = make_node()
    v = make_validator(gate={"read_grace_s": 1.0, "header_timeout_s": 1.0})
    assert v.service.cfg.flood.max_concurrent == 16  # the default, as in the attack
    domain, me = v.service.domain, v.service.identity.address
    sub, data = honest.build(counter=0)
    slow = [_slow_upload(v.url, source=f"127.0.0.{2 + i % 4}") for i in range(16)]  # four source addresses
    unstaked = Identity.create()  # a fresh key signs its header well: it has no stake, so its body is never read
    stranger = _slow_upload(v.url, upload_headers(unstaked, b"{" + b" " * 1999, domain=domain, validator=me,
                                                  path="/v1/submissions"))
    trickled = [_half_headers(v.url) for _ in range(8)]
    with v.client() as c:
        r = c.post("/v1/submissions", content=data,
                   headers=upload_headers(honest.identity, data, domain=domain, validator=me, path="/v1/submissions"))
        assert r.status_code == 202, r.text  # taken in while every slow upload is still open
    assert v.wait_decided(r.json()["work_key"])["outcome"] == "accepted"
    answers = [_answer(s).split(b"\r\n", 1)[0] for s in slow]
    # one per source address was read (until it lagged: 408), the others were refused at once (503)
    assert sorted(answers) == sorted([b"HTTP/1.1 408 Request Timeout"] * 4 + [b"HTTP/1.1 503 Service Unavailable"] * 12)
    assert _answer(stranger).startswith(b"HTTP/1.1 403 ")
    assert all(_answer(s) == b"" for s in trickled)  # closed at the header deadline, never answered
    stats = v.service.core.stats.snapshot()
    assert stats["refused_slow_upload"] == 4 and stats["closed_header_timeout"] >= 8, stats


def test_a_staked_signer_holds_at_most_its_own_slots(make_validator, make_node):
    """A staked key's slow uploads take `gate.slots_per_node` slots, never another node's."""
    greedy, honest = make_node(), make_node()
    v = make_validator(flood={"max_concurrent": 4}, gate={"slots_per_node": 2, "read_grace_s": 60.0})
    domain, me = v.service.domain, v.service.identity.address
    body = b"{" + b" " * 1999
    held = [_slow_upload(v.url, upload_headers(greedy.identity, body, domain=domain, validator=me,
                                               path="/v1/submissions")) for _ in range(3)]
    assert _answer(held[2]).startswith(b"HTTP/1.1 503 ")  # its third is refused at once
    _, data = honest.build(counter=0)
    with v.client() as c:
        r = c.post("/v1/submissions", content=data,
                   headers=upload_headers(honest.identity, data, domain=domain, validator=me, path="/v1/submissions"))
        assert r.status_code == 202, r.text
        forged = dict(upload_headers(honest.identity, data, domain=domain, validator=me, path="/v1/submissions"))
        r = c.post("/v1/submissions", content=data + b" ", headers=forged)  # not the bytes it signed
        assert r.status_code == 400 and r.json()["error"] == "body_mismatch", r.text
    for s in held[:2]:
        s.close()


def test_the_replay_guard_of_the_intake_forgets_expired_nonces(make_validator, make_node):
    """replay.sqlite holds only the nonces of the last age window (issue 23 item 13: it was given a monotonic
    clock, against which no wall-clock expiry ever passed, so it grew forever)."""
    node = make_node()
    v = make_validator(**FAST)
    guard, gate = v.service.replay, v.service.core.intake.replay_guard
    sent = time.time() - 2 * v.service.cfg.max_age_s
    gate.check_and_record(v.service.domain, node.identity.address, 1, sent_at=sent, expires_at=sent + 1.0)
    assert len(guard) == 1
    with v.client() as c:
        assert c.post("/v1/submissions", content=_cheap_failures(node, 1)[0]).status_code == 200
    assert len(guard) == 1  # the expired nonce was pruned when the next one was recorded
    assert guard.horizon == sent
