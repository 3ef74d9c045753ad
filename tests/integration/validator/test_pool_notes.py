"""What one validator knows, the pool knows (issue 35 item 7): two real validators on 127.0.0.1 against anvil and a
node that splits its work between them by version (rendezvous assignment). Validator B reads validator A's signed
notes (`GET /v1/peer/notes`): a hard verdict A decided and has not reported yet holds the node at B too, and holes
the node left at A count against it at B. A peer URL serving forged, unsigned, stale or replayed notes changes
nothing."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from chainfixtures import VALIDATOR, VALIDATOR2, Pools
from fastapi import FastAPI, Request
from fastapi.responses import Response
from netfixtures import free_port

from bench.adversaries import SimNode, steer_logprobs
from bench.loopback import MANIFEST_V0, RUN, Served, serve_asgi
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.pool_notes import PATH, NodeNote, PoolNotes
from protocol.seeds import validator_ranking
from protocol.upload import upload_headers

pytestmark = pytest.mark.timeout(300)

FAST = {"rate_per_node": 1000.0, "rate_burst": 1000}


def _post(v: Served, data: bytes) -> httpx.Response:
    with v.client() as c:
        return c.post("/v1/submissions", content=data)


def _splitter(published: Pools, make_node: Any, first: dict[int, str]) -> SimNode:
    """A registered node whose work at each version of `first` goes to that validator first (of A and B)."""
    validators = [published.chain.account(VALIDATOR).address, published.chain.account(VALIDATOR2).address]
    for _ in range(1000):
        key = Identity.create()
        if all(validator_ranking(RUN.run_id, key.address, v, validators)[0] == who for v, who in first.items()):
            node: SimNode = make_node(identity=key)
            return node
    raise AssertionError("no key met the premise in 1000 tries")


def _wait(what: Callable[[], object], why: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _relay_the_rest(app: FastAPI, url: str) -> None:
    """Every route `app` does not answer itself is relayed to the validator at `url`: its `/v1/info`, proved by its
    key, makes a peer believe that `app`'s URL is that validator."""

    @app.api_route("/{rest:path}", methods=["GET", "POST"])
    async def relay(rest: str, request: Request) -> Response:
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.request(request.method, "/" + rest, params=request.query_params, content=await request.body(),
                                headers={k: v for k, v in request.headers.items()
                                         if k.lower() not in ("host", "content-length")})
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower().startswith("x-prime")})


def _pair(published: Pools, make_validator: Any, **b_overrides: Any) -> tuple[str, str, Served, Served]:
    """Validators A (no peers: it only serves its notes) and B (A as its peer, polling A's notes quickly)."""
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(VALIDATOR2).address
    published.admin.grant_role("validator", b)
    # A's hard verdicts wait out a long systemic window: not on chain during the test
    va = make_validator("a", account=VALIDATOR, validators=[a, b], **FAST,
                        systemic={"window_s": 60.0, "min_nodes": 100, "fraction": 1.0})
    vb = make_validator("b", account=VALIDATOR2, validators=[a, b], peers=[va.url], **FAST,
                        pool_notes={"interval_s": 0.2, "cache_s": 0.0}, **b_overrides)
    return a, b, va, vb


def test_a_hard_verdict_pending_at_one_validator_holds_the_node_at_the_other(published, make_validator, make_node):
    a, b, va, vb = _pair(published, make_validator)
    node = _splitter(published, make_node, {1: a, 2: b})
    address = node.identity.address
    sub, _ = node.build(counter=0, cheat="unassigned_task")  # fails a cheap check: hard at once, at A
    r = _post(va, node.seal(sub))
    assert r.status_code == 200 and r.json()["outcome"] == "rejected_hard", r.text

    published.trainer.publish_policy(2, MANIFEST_V0)
    _wait(lambda: vb.service.chain.current_version() == 2, "B never saw v2")
    pool = vb.service.pool_view
    assert pool is not None
    _wait(lambda: pool.hard_pending_at(address) == a, f"B never took A's notes: {pool.status()}")

    _, data = node.build(version=2, counter=0)  # honest work, assigned to B: the node tries its luck there
    r = _post(vb, data)
    assert (r.status_code, r.json().get("error")) == (429, "node_quota"), r.text
    assert a in r.json()["detail"] and int(r.headers["Retry-After"]) >= 1
    assert vb.service.ledger.get("0x" + published.work_key(RUN.run_id, address, 2, 0).hex()) is None
    # another node's work at B is taken as before
    other = _splitter(published, make_node, {2: b})
    r = _post(vb, other.build(version=2, counter=0)[1])
    assert r.status_code == 202, r.text


def test_a_hard_verdict_reaches_the_peers_at_once_not_at_their_next_fetch(published, make_validator, make_node):
    """B took A's pending hard verdict only at its next fetch of A's notes (`pool_notes.interval_s`, 5 s by
    default, plus A's `cache_s`): time in which the node, held at A, could spread work to B. Now A pushes its
    notes to its peers as soon as a hard verdict is pending there. Here B can never fetch A's notes: its peer URL
    for A relays A's proved `/v1/info` but answers every fetch of the notes with 503. B holds the node all the
    same, from the push alone. A key that is not a run validator cannot push."""
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(VALIDATOR2).address
    published.admin.grant_role("validator", b)
    port_b = free_port()
    va = make_validator("a", account=VALIDATOR, validators=[a, b], peers=[f"http://127.0.0.1:{port_b}"], **FAST,
                        systemic={"window_s": 60.0, "min_nodes": 100, "fraction": 1.0}, pool_notes={"cache_s": 0.0})
    app = FastAPI()

    @app.get(PATH)
    def no_notes() -> Response:
        return Response(b"down for maintenance", status_code=503)

    _relay_the_rest(app, va.url)
    with serve_asgi(app) as unfetchable:
        vb = make_validator("b", account=VALIDATOR2, port=port_b, validators=[a, b], peers=[unfetchable], **FAST,
                            pool_notes={"interval_s": 0.2, "cache_s": 0.0})
        stats_a, stats_b = va.service.core.stats, vb.service.core.stats
        _wait(lambda: b in va.service.peers.urls(), "A never identified B (its probe)")
        _wait(lambda: stats_b.get("pool_notes_unreachable"), f"B never tried to fetch A's notes: {stats_b.snapshot()}")
        pool = vb.service.pool_view
        assert pool is not None
        node = _splitter(published, make_node, {1: a, 2: b})
        address = node.identity.address
        sub, _ = node.build(counter=0, cheat="unassigned_task")  # fails a cheap check: hard at once, at A
        r = _post(va, node.seal(sub))
        assert r.status_code == 200 and r.json()["outcome"] == "rejected_hard", r.text
        _wait(lambda: pool.hard_pending_at(address) == a, f"A's push never reached B: {pool.status()}", timeout=60)
        _wait(lambda: stats_b.get("pool_notes_push_taken") == 1 and stats_a.get("pool_notes_pushed") == 1,
              f"the push was not counted: A {stats_a.snapshot()} B {stats_b.snapshot()}")
        assert stats_b.get("pool_notes_taken") == 1 and not stats_a.get("pool_notes_push_failed")

        published.trainer.publish_policy(2, MANIFEST_V0)
        _wait(lambda: vb.service.chain.current_version() == 2, "B never saw v2")
        r = _post(vb, node.build(version=2, counter=0)[1])  # honest work, assigned to B: held
        assert (r.status_code, r.json().get("error")) == (429, "node_quota"), r.text

        # only a run validator may push, and only its own notes
        notes = va.service.notes.sealed()
        stranger = Identity.create()
        with vb.client() as c:
            r = c.post(PATH, content=notes, headers=upload_headers(stranger, notes, domain=vb.service.domain,
                                                                   validator=b, path=PATH))
            assert (r.status_code, r.json()["error"]) == (403, "no_standing"), r.text
            key_a = published.chain.account(VALIDATOR)
            mine = vb.service.notes.sealed()  # B's own notes, pushed to B by A: not A's
            r = c.post(PATH, content=mine, headers=upload_headers(key_a, mine, domain=vb.service.domain, validator=b,
                                                                  path=PATH))
            assert r.status_code == 401, r.text
        assert pool.hard_pending_at(address) == a


def test_holes_left_at_one_validator_count_at_the_other(published, make_validator, make_node):
    a, b, va, vb = _pair(published, make_validator, flood={"max_holes": 0})
    node = _splitter(published, make_node, {1: a, 3: b})
    address = node.identity.address
    for counter in (0, 2):  # counter 1 skipped at A (inside the gap, so #2 is taken)
        r = _post(va, node.build(counter=counter)[1])
        assert r.status_code == 202, r.text
    published.trainer.publish_policy(2, MANIFEST_V0)
    published.trainer.publish_policy(3, MANIFEST_V0)  # v1 leaves the async window: A counts the hole
    _wait(lambda: va.service.ledger.counter_holes() == {address: 1}, "A never counted the hole")
    _wait(lambda: vb.service.chain.current_version() == 3, "B never saw v3")
    pool = vb.service.pool_view
    assert pool is not None
    _wait(lambda: pool.holes_since(address, 0) == 1, f"B never took A's notes: {pool.status()}")
    assert vb.service.ledger.counter_holes() == {}  # B itself saw no hole

    r = _post(vb, node.build(version=3, counter=0)[1])
    assert (r.status_code, r.json().get("error")) == (429, "too_many_holes"), r.text
    assert vb.service.ledger.get("0x" + published.work_key(RUN.run_id, address, 3, 0).hex()) is None


def test_forged_unsigned_stale_or_replayed_notes_change_nothing(published, make_validator, make_node):
    """B's peer URL relays A's proved `/v1/info` (so B takes it for A) but serves notes of its own making, each
    claiming a hard verdict pending on the node: not a notes envelope, signed by another key, A's key in another
    domain, signed an hour ago, and a replay of A's older notes after newer ones. Each is refused and counted; the
    node's work at B is taken."""
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(VALIDATOR2).address
    published.admin.grant_role("validator", b)
    va = make_validator("a", account=VALIDATOR, validators=[a, b], **FAST)
    node = _splitter(published, make_node, {1: b})
    address = node.identity.address
    domain = va.service.domain
    key_a = published.chain.account(VALIDATOR)

    def claim(at: float) -> PoolNotes:  # a hard verdict on the node, decided 10 s before the document
        return PoolNotes(current_version=1, nodes=(NodeNote(node=address, hard_pending=1,
                                                            hard_oldest_ms=int((at - 10) * 1000)),))

    def sealed(who: Identity, at: float, dom: str = domain, body: PoolNotes | None = None) -> bytes:
        return seal(who, claim(at) if body is None else body, domain=dom, nonce=random_nonce(), now=at).to_bytes()

    stranger = Identity.create()
    documents: Iterator[Callable[[float], bytes]] = itertools.cycle([  # each sealed when served
        lambda t: b'{"nodes": []}',  # not an envelope at all
        lambda t: claim(t).model_dump_json().encode(),  # the body, unsigned
        lambda t: sealed(stranger, t),  # forged: another key
        lambda t: sealed(key_a, t, dom=domain + "-other"),  # A's key, another run
        lambda t: sealed(key_a, t - 3600),  # A's, an hour old
        lambda t: sealed(key_a, t + 5, body=PoolNotes(current_version=1)),  # A's newest (nothing on the node): taken
        lambda t: sealed(key_a, t - 5),  # A's older notes replayed after the newer
    ])
    app = FastAPI()

    @app.get(PATH)
    def notes() -> Response:
        return Response(next(documents)(time.time()), media_type="application/json")

    _relay_the_rest(app, va.url)

    with serve_asgi(app) as hostile:
        vb = make_validator("b", account=VALIDATOR2, validators=[a, b], peers=[hostile], **FAST,
                            pool_notes={"interval_s": 0.1, "cache_s": 0.0})
        pool = vb.service.pool_view
        assert pool is not None
        stats = vb.service.core.stats
        codes = ["protocol", "bad_signature", "wrong_domain", "expired", "stale_notes"]
        _wait(lambda: all(stats.get(f"pool_notes_refused_{c}") for c in codes) and stats.get("pool_notes_taken"),
              f"not every forged document was fetched: {stats.snapshot()} {pool.status()}")
        assert pool.hard_pending_at(address) is None
        assert pool.near_tie_account(address) == (0, 0, 0)
        r = _post(vb, node.build(counter=0)[1])
        assert r.status_code == 202, r.text


def test_a_peer_serving_what_the_node_never_signed_for_the_assignment_slashes_no_one(published, make_validator,
                                                                                     make_node):
    """The cross-check (`validator.crosscheck`) believes only the node's signature. A's key records three of the
    node's assignments on chain that B accepted; B's peer URL relays A's proved `/v1/info` (so B takes it for A) but
    serves, for each, a row naming another payload and then: an envelope of the same assignment signed by another
    key, the node's own envelope of another assignment, bytes that do not hash to the name. Each is refused and
    counted; B's rows stay accepted, nothing is slashed."""
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(VALIDATOR2).address
    published.admin.grant_role("validator", b)
    va = make_validator("a", account=VALIDATOR, validators=[a, b], **FAST)
    node = _splitter(published, make_node, {1: b})
    address = node.identity.address
    domain = va.service.domain
    subs = [node.build(counter=c) for c in range(3)]
    keys = ["0x" + published.work_key(RUN.run_id, address, 1, c).hex() for c in range(3)]
    forged = seal(Identity.create(), steer_logprobs(subs[0][0]), domain=domain, nonce=random_nonce()).to_bytes()
    elsewhere = node.build(counter=7)[1]  # genuine, never sent: another assignment
    served = {keys[0]: forged, keys[1]: elsewhere, keys[2]: b"{}"}
    names = {k: "0x" + hashlib.sha256(v).hexdigest() for k, v in served.items()}
    names[keys[2]] = "0x" + "ab" * 32  # what it serves under this name hashes to something else
    app = FastAPI()

    @app.get("/v1/submissions/{key}")
    def row(key: str) -> dict[str, str]:
        return {"submission_hash": names[key]}

    @app.get("/v1/envelopes/{name}")
    def envelope(name: str) -> Response:
        return Response(next(served[k] for k, n in names.items() if n == name), media_type="application/json")

    _relay_the_rest(app, va.url)

    with serve_asgi(app) as hostile:
        vb = make_validator("b", account=VALIDATOR2, validators=[a, b], peers=[hostile], **FAST,
                            reporter={"enabled": False}, pool_notes={"crosscheck_s": 0.1})
        for _, data in subs:
            assert _post(vb, data).status_code == 202
        _wait(lambda: all((r := vb.service.ledger.get(k)) is not None and r.outcome == "accepted" for k in keys),
              "B never accepted the node's work")
        _wait(lambda: a in vb.service.peers.urls(), "B never took the hostile URL for A")
        published.validator.record_work_batch([(address, k, 1) for k in keys])  # A's key records them
        stats = vb.service.core.stats
        _wait(lambda: stats.get("crosscheck_refused") == 3, f"B never refused all three: {stats.snapshot()}")
        assert all((r := vb.service.ledger.get(k)) is not None and r.outcome == "accepted" for k in keys)
        assert not stats.get("crosscheck_equivocation")
