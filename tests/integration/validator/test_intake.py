"""The validator's HTTP intake on 127.0.0.1 against anvil: the honest path end to end, then every bad input."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest

from bench.adversaries import SimNode
from contracts.pool import WorkStatus
from protocol.envelope import Envelope, open_envelope
from protocol.replay import ReplayGuard
from protocol.rollout import FeedItem, Verdict
from protocol.rollout_files import feed_groups, read_rollouts
from protocol.upload import upload_headers
from validator.chainview import CATCHUP_S

pytestmark = pytest.mark.timeout(240)


def test_honest_submission_is_accepted_recorded_on_chain_and_fed(make_validator, make_node, published, tmp_path):
    feed_dir = tmp_path / "feed"
    node: SimNode = make_node()  # registered before the validator reads the chain
    v = make_validator(feed_dir=feed_dir)
    sub, data = node.build()
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code == 202, r.text
        key = r.json()["work_key"]
        row = v.wait_reported(key)
        assert row["outcome"] == "accepted", row
        assert row["reason"] == "accepted"
        assert row["chain_tx"]
        samples = row["measurements"]["samples"]
        assert len(samples) == 4 and all(s["failing_chunks"] == [] and s["sampling_mismatches"] == [] for s in samples)
        # on chain, once, with the units the validator computed
        work = published.admin.get_work(key)
        assert work.status == WorkStatus.ACCEPTED and work.node == node.identity.address
        # the signed verdict opens with the validator's key
        verdict = open_envelope(Envelope.model_validate_json(row["verdict"]), domain=v.service.domain,
                                replay_guard=ReplayGuard(":memory:"), expected_signer=v.service.identity.address)
        assert isinstance(verdict, Verdict) and verdict.outcome.value == "accepted"
        assert "0x" + verdict.work_key.hex() == key
        # the feed: over HTTP (signed) and as a Parquet file the trainer's directory source reads
        feed = c.get("/v1/feed", params={"after": 0}).json()
        assert [i["work_key"] for i in feed["items"]] == [key]
        item = open_envelope(Envelope.model_validate_json(feed["items"][0]["envelope"]), domain=v.service.domain,
                             replay_guard=ReplayGuard(":memory:"), expected_signer=v.service.identity.address)
        assert isinstance(item, FeedItem)
        groups = feed_groups(item)
        assert [len(g) for g in groups] == [2, 2]
        assert groups[0][0].tokens[-len(sub.tasks[0].samples[0].tokens):] == sub.tasks[0].samples[0].tokens
        assert c.get("/v1/feed", params={"after": feed["next"]}).json()["items"] == []
        # re-posting the identical envelope: the same verdict, never a second row
        again = c.post("/v1/submissions", content=data)
        assert again.status_code == 200 and again.json()["verdict"] == row["verdict"]
        # the same payload sealed again (a retry with a new nonce) is not equivocation either
        assert c.post("/v1/submissions", content=node.seal(sub)).json()["outcome"] == "accepted"
        info = c.get("/v1/info").json()
        assert info["current_version"] == 1 and info["run"]["run_id"] == "test-run"
        assert c.get(f"/v1/nodes/{node.identity.address}").json()["verdicts"] == {"accepted": {"accepted": 1}}
        listed = c.get("/v1/submissions", params={"after": 0}).json()  # the operator's timeline
        assert [(i["work_key"], i["node"], i["policy_version"], i["outcome"]) for i in listed["items"]] == [
            (key, node.identity.address, 1, "accepted")]
        assert listed["items"][0]["received_at"] <= listed["items"][0]["decided_at"] <= time.time()
        assert c.get("/v1/submissions", params={"after": listed["next"]}).json()["items"] == []
        assert c.get("/v1/submissions", params={"limit": 0}).status_code == 400
        assert c.get("/ready").status_code == 200 and c.get("/health").json() == {"status": "ok"}
        assert "prime_validator_ledger_rows" in c.get("/metrics").text
    for _ in range(100):
        files = sorted(feed_dir.glob("*.parquet"))
        if files:
            break
        time.sleep(0.1)
    assert len(files) == 1 and not list(feed_dir.glob("*.tmp"))
    rows = read_rollouts(files[0])
    assert len(rows) == 4 and {s.policy_version for s in rows} == {1}
    assert sorted(s.reward for s in rows) == sorted(s.reward for t in sub.tasks for s in t.samples)


def _count_rows(v) -> int:  # type: ignore[no-untyped-def]
    return sum(n for k, n in v.service.ledger.counts().items() if k.startswith("state:"))


def test_bad_inputs_get_their_status_and_a_ledger_row_where_they_have_a_sender(make_validator, make_node):
    node = make_node()
    stranger = make_node(register=False)
    v = make_validator(max_submission_bytes=200_000, rate_burst=3, rate_per_node=0.01)
    _, good = node.build()
    with v.client() as c:
        # oversize: refused from Content-Length before the body is read, and while a chunked body streams
        assert c.post("/v1/submissions", content=b"x" * 200_001).status_code == 413
        assert c.post("/v1/submissions", content=iter([b"x" * 100_000] * 3)).status_code == 413
        # malformed
        for junk in (b"", b"{", b"[1,2]", b'{"kind":"submission"}', b"[" * 100_000):
            r = c.post("/v1/submissions", content=junk)
            assert r.status_code == 400, (junk[:20], r.text)
        # forged: a signature byte flipped
        env = json.loads(good)
        sig = bytearray(bytes.fromhex(env["signature"][2:]))
        sig[5] ^= 1
        env["signature"] = "0x" + sig.hex()
        forged = Envelope.model_validate(env).to_bytes()
        assert c.post("/v1/submissions", content=forged).status_code == 401
        # an unregistered key: 403, counted in the metrics only (fresh keys are free: no ledger row each)
        _, from_stranger = stranger.build()
        r = c.post("/v1/submissions", content=from_stranger)
        assert r.status_code == 403 and r.json()["error"] == "node_inactive"
        assert c.get(f"/v1/nodes/{stranger.identity.address}").json()["refused"] == {}
        assert 'prime_validator_events{event="refused_node_inactive"} 1.0' in c.get("/metrics").text
        # the honest one goes through; then a different body under the same nonce is a replay
        assert c.post("/v1/submissions", content=good).status_code == 202
        other_sub, _ = node.build()
        same_nonce = json.loads(good)["nonce"]
        from protocol.envelope import seal

        replayed = seal(node.identity, other_sub, domain=v.service.domain, nonce=same_nonce).to_bytes()
        r = c.post("/v1/submissions", content=replayed)
        assert r.status_code == 409 and r.json()["error"] == "replay"
        # rate limit: the bucket held 3; a 4th signed submission waits, with Retry-After
        statuses = [c.post("/v1/submissions", content=node.build()[1]).status_code for _ in range(2)]
        assert statuses == [202, 429], statuses
        last = c.post("/v1/submissions", content=node.build()[1])
        assert last.status_code == 429 and int(last.headers["Retry-After"]) >= 1
        refused = c.get(f"/v1/nodes/{node.identity.address}").json()["refused"]
        assert refused["replay"] == 1 and refused["rate_limited"] == 2
    assert _count_rows(v) == 2  # only the two accepted-for-checking submissions became rows


def test_evidence_hash_is_the_sha256_of_what_is_served(make_validator, make_node):
    node = make_node()
    v = make_validator()
    _, data = node.build(cheat="inflate_reward")
    with v.client() as c:
        key = c.post("/v1/submissions", content=data).json()["work_key"]
        row = v.wait_decided(key)
        assert row["outcome"] == "rejected_hard" and row["reason"] == "reward_mismatch"
        ev = c.get(f"/v1/evidence/{row['evidence_hash']}")
        assert ev.status_code == 200
        assert "0x" + hashlib.sha256(ev.content).hexdigest() == row["evidence_hash"]
        # the submission is stored once (its row), named in the evidence by hash and served by it
        assert json.loads(ev.content)["submission_hash"] == row["submission_hash"] == "0x" + hashlib.sha256(data).hexdigest()
        assert data not in ev.content and len(ev.content) < len(data)
        assert c.get(f"/v1/envelopes/{row['submission_hash']}").content == data
        assert c.get("/v1/envelopes/0x" + "00" * 32).status_code == 404
        assert c.get("/v1/evidence/0x" + "00" * 32).status_code == 404
        assert c.get("/v1/evidence/nothex").status_code == 400


def test_two_payloads_for_one_assignment_at_once_are_equivocation_whoever_wins(make_validator, make_node):
    from concurrent.futures import ThreadPoolExecutor

    node = make_node()
    v = make_validator()
    _, first = node.build(counter=0)
    _, second = node.build(counter=0, cheat="inflate_reward")
    def post(data: bytes) -> Any:  # signed upload headers: two at once from one address (unsigned ones get one slot)
        return c.post("/v1/submissions", content=data, headers=upload_headers(
            node.identity, data, domain=v.service.domain, validator=v.service.identity.address, path="/v1/submissions"))

    with v.client() as c, ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(post, [first, second]))
        statuses = sorted(a.status_code for a in answers)
        assert statuses[1] == 409 and statuses[0] in (200, 202), [a.text for a in answers]
        key = answers[0].json()["work_key"]
        row = v.wait_decided(key)
        assert (row["outcome"], row["reason"]) == ("rejected_hard", "equivocation")
    assert _count_rows(v) == 1


def test_a_node_registered_after_the_last_poll_is_not_refused(make_validator, make_node, published,
                                                               deployment_file):
    """The validator's chain poll is slow here (30 s): a node that registers and submits at once is seen by the
    intake's own catch-up, not refused 403 (that race stopped nodes whose first batch beat the poll, and hung
    tests/integration/node/test_engine_conformance.py under load). A signer that is not registered is still
    refused (403 once a view read after it asked says so; 503 `chain_unavailable` while no such view can be had),
    and costs at most one catch-up per CATCHUP_S."""
    v = make_validator(chain={"deployment": deployment_file, "rpc_url": published.chain.rpc_url, "poll_s": 30.0})
    node: SimNode = make_node()  # registered after the validator's last read of the chain
    stranger: SimNode = make_node(register=False)
    _, data = node.build()
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code == 202, r.text
        assert v.wait_decided(r.json()["work_key"])["outcome"] == "accepted"
        chain, began = v.service.chain, time.monotonic()
        before = chain.catchups
        answers = [c.post("/v1/submissions", content=stranger.build()[1]) for _ in range(5)]
        for a in answers:
            assert (a.status_code, a.json()["error"]) in ((403, "node_inactive"), (503, "chain_unavailable")), a.text
            assert a.status_code == 403 or int(a.headers["Retry-After"]) >= 1
        # one catch-up per CATCHUP_S at most, however many refused requests
        assert chain.catchups - before <= 1 + (time.monotonic() - began) / CATCHUP_S
        # sent again after its Retry-After, the stranger meets a view read after it asked: refused for good
        while (r := c.post("/v1/submissions", content=stranger.build()[1])).status_code == 503:
            time.sleep(float(r.headers["Retry-After"]))
        assert (r.status_code, r.json()["error"]) == (403, "node_inactive"), r.text
        assert c.get(f"/v1/nodes/{stranger.identity.address}").json()["refused"] == {}


@pytest.mark.parametrize("signed", [False, True], ids=["intake", "gate"])
def test_a_node_registered_just_after_anothers_catch_up_is_told_to_retry_not_refused(
        make_validator, make_node, published, deployment_file, monkeypatch, signed):
    """Issue 35: a catch-up with the chain runs at most once per CATCHUP_S, and a signer the view did not show
    as active in that time got 403 `node_inactive` (or `no_standing` at the gate), though it may have registered
    after the view was read: an honest node that registered just after a stranger's catch-up was refused. Now a
    no counts only from a view read after the request arrived; otherwise 503 `chain_unavailable` + Retry-After,
    held against no one, and the node is taken once the view has caught up. The catch-up interval is a minute
    here (the poll 30 s), so the second node's post falls inside it whatever the box's speed."""
    monkeypatch.setattr("validator.intake.CATCHUP_S", 60.0)
    monkeypatch.setattr("validator.app.CATCHUP_S", 60.0)
    v = make_validator(chain={"deployment": deployment_file, "rpc_url": published.chain.rpc_url, "poll_s": 30.0})
    stranger: SimNode = make_node(register=False)

    def post(c: Any, who: SimNode, data: bytes) -> Any:
        headers = upload_headers(who.identity, data, domain=v.service.domain, validator=v.service.identity.address,
                                 path="/v1/submissions") if signed else {}
        return c.post("/v1/submissions", content=data, headers=headers)

    with v.client() as c:
        r = post(c, stranger, stranger.build()[1])  # the first unknown signer: a catch-up, then a final no
        assert r.status_code == 403, r.text
        assert v.service.chain.catchups == 1
        late: SimNode = make_node()  # registered after that catch-up read the chain
        _, data = late.build()
        r = post(c, late, data)
        assert (r.status_code, r.json()["error"]) == (503, "chain_unavailable"), r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert v.service.chain.catchups == 1  # no second catch-up inside the interval
        assert c.get(f"/v1/nodes/{late.identity.address}").json()["refused"] == {}  # never held against it
        v.service.chain.try_refresh()  # what the poll does on its next round
        r = post(c, late, data)
        assert r.status_code == 202, r.text
        assert v.wait_decided(r.json()["work_key"])["outcome"] == "accepted"


def test_the_submission_replay_guard_prunes_by_the_wall_clock(make_validator, make_node):
    """Issue 23 item 13: the submission path's sender gate handed the replay guard a monotonic clock, so nothing
    ever expired and `replay.sqlite` grew forever. The guard now sees the wall time the envelope was judged by:
    expired nonces are pruned and the horizon moves up to them."""
    v = make_validator()
    node = make_node()
    gate, guard = v.service.core.intake.replay_guard, v.service.replay
    deadline = time.monotonic() + 30
    while not v.service.chain.node_active(node.identity.address):  # the chain view learns the new node
        assert time.monotonic() < deadline
        time.sleep(0.1)
    now = time.time()
    signer, domain = node.identity.address, v.service.domain
    gate.check_and_record(domain, signer, 1, sent_at=now - 1000.0, expires_at=now - 900.0, now=now)
    gate.check_and_record(domain, signer, 2, sent_at=now - 1.0, expires_at=now + 600.0, now=now)
    assert guard.horizon == now - 1000.0  # nonce 1 expired and was pruned
    assert guard.prune(now) == 0
