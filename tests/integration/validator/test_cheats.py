"""Each way of cheating gets the right reason code and class; hard ones are slashed on chain with evidence;
honest-but-stale work is soft; many nodes failing at once makes the validator suspect itself."""

from __future__ import annotations

import hashlib
import time

import pytest

from bench.loopback import MANIFEST_V0, tiny
from contracts.pool import WorkStatus

pytestmark = pytest.mark.timeout(300)

HARD_CHEATS = [
    ("other_weights", "proof_mismatch"),
    ("edit_token", "sampling_mismatch"),
    ("other_seed", "sampling_mismatch"),
    ("unassigned_task", "wrong_task"),
    ("inflate_reward", "reward_mismatch"),
    ("early_stop", "termination"),
]


def _post(v, data: bytes) -> str:  # type: ignore[no-untyped-def]
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code in (200, 202), r.text
        return str(r.json()["work_key"])


def test_each_cheat_is_caught_with_its_reason_and_slashed_with_evidence(make_validator, make_node, published):
    other = tiny(1)
    nodes = {cheat: make_node() for cheat, _ in HARD_CHEATS}
    honest = make_node()
    equivocator = make_node()
    v = make_validator(systemic={"window_s": 0.3, "min_nodes": 100, "fraction": 1.0})
    keys = {}
    for cheat, _ in HARD_CHEATS:
        _, data = nodes[cheat].build(cheat=cheat, model=other if cheat == "other_weights" else None)
        keys[cheat] = _post(v, data)
    honest_key = _post(v, honest.build()[1])
    # a reused counter: an honest payload, then a different one for the same assignment
    first, data = equivocator.build(counter=0)
    eq_key = _post(v, data)
    v.wait_decided(eq_key)
    _, second = equivocator.build(counter=0, cheat="inflate_reward")
    with v.client() as c:
        r = c.post("/v1/submissions", content=second)
        assert r.status_code == 409 and r.json()["error"] == "duplicate_work"
    expected = dict(HARD_CHEATS)
    stake = published.admin.params().min_stake
    penalty = published.admin.params().slash_penalty
    with v.client() as c:
        for cheat, key in [*keys.items(), ("equivocation", eq_key)]:
            row = v.wait_reported(key)
            reason = expected.get(cheat, "equivocation")
            assert (row["outcome"], row["reason"]) == ("rejected_hard", reason), (cheat, row["reason"], row["detail"])
            assert row["chain_tx"], cheat
            assert published.admin.get_work(key).status == WorkStatus.HARD_INVALIDATED, cheat
            node = nodes[cheat].identity.address if cheat in nodes else equivocator.identity.address
            assert published.admin.get_node(node).stake == stake - penalty, cheat
            ev = c.get(f"/v1/evidence/{row['evidence_hash']}")
            assert "0x" + hashlib.sha256(ev.content).hexdigest() == row["evidence_hash"], cheat
        # the measurements say why, in numbers
        proof = c.get(f"/v1/submissions/{keys['other_weights']}").json()["measurements"]["samples"][0]
        assert proof["failing_chunks"] and max(ch[0] for ch in proof["toploc"]) > 38
        edit = c.get(f"/v1/submissions/{keys['edit_token']}").json()["measurements"]["samples"][0]
        assert edit["failing_chunks"] == [] and len(edit["sampling_mismatches"]) >= 1
    assert v.wait_reported(honest_key)["outcome"] == "accepted"
    assert published.admin.get_node(honest.identity.address).stake == stake


def test_stale_work_is_refused_without_a_row_never_slashed(make_validator, make_node, published):
    """Issue 35 item 3: stale work is refused at intake like future work, with no ledger row, no stored envelope
    and no transaction (it used to cost a row and an `invalidateSoft` each), counted against the node."""
    node = make_node()
    v = make_validator()
    sub, data = node.build(version=1)
    published.trainer.publish_policy(2, hashlib.sha256(b"v2").digest())
    published.trainer.publish_policy(3, hashlib.sha256(b"v3").digest())  # async level 1: v1 is now stale
    deadline = time.monotonic() + 30
    while v.service.chain.current_version() != 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for copy in (data, node.build(version=1)[1], node.build(version=1, cheat="junk")[1]):  # resent, resealed, junk
        with v.client() as c:
            r = c.post("/v1/submissions", content=copy)
        assert r.status_code == 410 and r.json()["error"] == "stale_version", r.text
    key = "0x" + published.work_key(sub.run_id, node.identity.address, 1, sub.counter).hex()
    assert v.service.ledger.get(key) is None and v.service.ledger.counts() == {}
    assert v.service.ledger.node_summary(node.identity.address)["refused"] == {"stale_version": 3}
    assert published.admin.get_work(key).status == WorkStatus.NONE
    assert published.admin.get_node(node.identity.address).stake == published.admin.params().min_stake
    # a version the chain has not seen: refused for now (425), no row, the assignment stays free
    _, future = node.build(version=9)
    with v.client() as c:
        r = c.post("/v1/submissions", content=future)
        assert r.status_code == 425 and r.json()["error"] == "future_version"
    _, wrong_manifest = node.build(version=3)  # the node names v0's manifest for v3
    row = v.wait_decided(_post(v, wrong_manifest))
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "wrong_manifest")
    assert MANIFEST_V0 != published.admin.policy()[1]


def test_a_lone_cheater_is_still_slashed_among_honest_nodes(make_validator, make_node, published):
    honest = [make_node() for _ in range(3)]
    cheater = make_node()
    v = make_validator(systemic={"window_s": 1.0, "min_nodes": 3, "fraction": 0.5})
    keys = [_post(v, n.build()[1]) for n in honest]
    bad = _post(v, cheater.build(cheat="other_seed")[1])
    assert all(v.wait_reported(k)["outcome"] == "accepted" for k in keys)
    row = v.wait_reported(bad)
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "sampling_mismatch")
    assert published.admin.get_work(bad).status == WorkStatus.HARD_INVALIDATED


class _BrokenGrader:
    """The run's environment whose grader cannot grade (an overloaded or broken validator)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner

    def sample(self, seed: int, n: int):  # type: ignore[no-untyped-def]
        return self.inner.sample(seed, n)

    def reward(self, task, completion, *, completion_tokens=None):  # type: ignore[no-untyped-def]
        from protocol.errors import UngradableError

        raise UngradableError("math-verify worker timed out")


def test_our_grader_failing_is_retried_then_soft_never_slashed(make_validator, make_node, published):
    node = make_node()
    v = make_validator(checks={"retries": 1})
    v.service.core.assignment.env = _BrokenGrader(v.service.core.assignment.env)
    row = v.wait_reported(_post(v, node.build()[1]))
    assert (row["outcome"], row["reason"]) == ("rejected_soft", "ungradable"), row
    assert "timed out" in row["detail"]
    assert published.admin.get_work(row["work_key"]).status == WorkStatus.NONE  # not burnt on chain
    assert published.admin.get_node(node.identity.address).stake == published.admin.params().min_stake
