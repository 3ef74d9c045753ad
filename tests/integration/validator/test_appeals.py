"""Appeals against a real anvil pool and real validators on 127.0.0.1 with the tiny model: a cheater's appeal is
upheld (the escrow goes to the treasury), a late appeal and one by someone else are refused by the contract and by
the validator, and a validator that cannot re-check says so without resolving anything. (A won appeal, through
`prime-node appeal`, is tests/integration/node/test_node_appeal.py.)"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from chainfixtures import SETTINGS, TREASURY, VALIDATOR2, Pools

from bench.adversaries import SimNode
from bench.loopback import tiny
from contracts.pool import EscrowStatus, NodeStatus, WorkStatus
from protocol.appeal import Appeal
from protocol.envelope import Envelope, seal
from protocol.errors import ChainError
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.upload import upload_headers

pytestmark = pytest.mark.timeout(300)


def _slashed(v: Any, node: SimNode, **build: Any) -> tuple[str, str, bytes]:
    """(work key, the signed verdict, the submission envelope) of a submission `v` rejected hard and slashed."""
    _, data = node.build(**build)
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code in (200, 202), r.text
        key = str(r.json()["work_key"])
    row = v.wait_reported(key)
    assert row["outcome"] == "rejected_hard", row
    return key, str(row["verdict"]), data


def _appeal(signer: Identity, node: SimNode, key: str, verdict: str, submission: bytes) -> bytes:
    body = Appeal(run_id=node.run.run_id, node=node.identity.address, work_key=bytes.fromhex(key[2:]),
                  verdict=verdict, submission=submission.decode())
    return seal(signer, body, domain=node.domain, nonce=random_nonce()).to_bytes()


def _post(v: Any, signer: Identity, data: bytes) -> tuple[int, dict[str, Any]]:
    """POST an appeal with `signer`'s upload header (the gate checks it before the body)."""
    headers = upload_headers(signer, data, domain=v.service.domain, validator=v.service.identity.address,
                             path="/v1/appeals")
    with v.client() as c:
        r = c.post("/v1/appeals", content=data, headers=headers)
        return r.status_code, dict(r.json())


def _chain_reason(call: Any) -> str:
    with pytest.raises(ChainError) as exc:
        call()
    return str(exc.value.reason)


@pytest.fixture
def second_validator(published: Pools) -> int:
    published.admin.grant_role("validator", published.chain.account(VALIDATOR2).address)
    return VALIDATOR2


def test_a_cheaters_appeal_is_upheld_and_the_escrow_goes_to_the_treasury(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    node = make_node()
    slasher = make_validator("a")
    checker = make_validator("b", account=second_validator)
    key, verdict, submission = _slashed(slasher, node, cheat="other_weights", model=tiny(1))  # a swapped model
    token = published.token()
    treasury = published.chain.account(TREASURY).address
    before = token.balance_of(treasury)
    assert published.admin.get_escrow(key).status is EscrowStatus.HELD

    published.operator.appeal(key)
    status, answer = _post(checker, node.identity, _appeal(node.identity, node, key, verdict, submission))

    assert status == 200, answer
    assert (answer["outcome"], answer["reason"], answer["original_reason"]) == ("upheld", "proof_mismatch",
                                                                              "proof_mismatch")
    assert answer["resolved"] and answer["chain_tx"]
    worst = max(ch[0] for s in answer["measurements"]["samples"] for ch in s["toploc"])
    assert worst > checker.service.cfg.checks.max_exp_mismatches
    decision = Envelope.model_validate_json(answer["decision"])
    assert decision.signer == checker.service.identity.address and decision.body["outcome"] == "upheld"
    assert published.admin.get_escrow(key).status is EscrowStatus.UPHELD
    assert token.balance_of(treasury) == before + SETTINGS.slash_penalty
    info = published.admin.get_node(node.identity.address)
    assert info.status is NodeStatus.EJECTED and info.stake == SETTINGS.min_stake - SETTINGS.slash_penalty
    assert published.admin.get_work(key).status is WorkStatus.HARD_INVALIDATED
    with checker.client() as c:  # the re-check's record is served; its hash is the one on chain
        import hashlib

        evidence = c.get(f"/v1/evidence/{answer['evidence_hash']}")
        assert "0x" + hashlib.sha256(evidence.content).hexdigest() == answer["evidence_hash"]
        assert c.get(f"/v1/appeals/{key}").json()["outcome"] == "upheld"
    # decided once: asking again returns the same decision, resolving nothing twice
    status, again = _post(checker, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert status == 200 and again["evidence_hash"] == answer["evidence_hash"]


def test_work_just_outside_the_intake_tolerance_stays_slashed_on_appeal_while_our_mistakes_are_overturned(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    """Issue 23 item 8: the appeal re-checks with the intake thresholds, so a cheat aiming just past the logprob
    tolerance gains nothing by appealing; honest work a miscalibrated validator slashed is still restored."""
    slasher = make_validator("a")
    strict = make_validator("strict", account=second_validator, checks={"logprob_tolerance": 0.0})
    cheater, honest = make_node(), make_node()
    key, verdict, submission = _slashed(slasher, cheater, cheat="logprob_shift")
    assert slasher.wait_reported(key)["reason"] == "logprob_mismatch"
    published.operator.appeal(key)
    status, answer = _post(strict, cheater.identity, _appeal(cheater.identity, cheater, key, verdict, submission))
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"]) == ("upheld", "logprob_mismatch"), answer
    assert 0.5 < max(s["logprob_max_error"] for s in answer["measurements"]["samples"]) < 0.52
    assert published.admin.get_escrow(key).status is EscrowStatus.UPHELD  # the stake stays slashed
    assert published.admin.get_node(cheater.identity.address).stake == SETTINGS.min_stake - SETTINGS.slash_penalty

    # the strict validator's own mistake (tolerance 0: honest float noise of ~1e-6 fails) is overturned
    key, verdict, submission = _slashed(strict, honest)
    published.operator.appeal(key)
    status, answer = _post(slasher, honest.identity, _appeal(honest.identity, honest, key, verdict, submission))
    assert status == 200, answer
    assert (answer["outcome"], answer["original_reason"]) == ("overturned", "logprob_mismatch"), answer
    assert published.admin.get_escrow(key).status is EscrowStatus.OVERTURNED
    assert published.admin.get_node(honest.identity.address).stake == SETTINGS.min_stake


def test_late_appeals_and_appeals_by_someone_else_are_refused(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    node = make_node()
    slasher = make_validator("a")
    checker = make_validator("b", account=second_validator)
    key, verdict, submission = _slashed(slasher, node, cheat="inflate_reward")
    stranger, other = Identity.create(), make_node().identity

    # someone else: refused by the validator (signature of neither the node nor its operator) and the contract; a
    # key the pool never registered is refused at the gate, before its body is read
    status, answer = _post(checker, stranger, _appeal(stranger, node, key, verdict, submission))
    assert (status, answer["error"]) == (403, "no_standing")
    deadline = time.monotonic() + 60
    while not checker.service.chain.known(other.address):  # a registered key is let through to the body
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, answer = _post(checker, other, _appeal(other, node, key, verdict, submission))
    assert (status, answer["error"]) == (403, "not_appellant")
    assert _chain_reason(lambda: published.stranger.appeal(key)) == "NotOperator"
    # the slasher never judges its own verdict; an appeal not filed on chain is not taken
    status, answer = _post(slasher, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert (status, answer["error"]) == (409, "own_verdict")
    status, answer = _post(checker, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert (status, answer["error"]) == (409, "not_filed")
    # a verdict that is not the one slashed, or a submission it did not judge
    status, answer = _post(checker, node.identity, _appeal(node.identity, node, key, verdict, node.build()[1]))
    assert (status, answer["error"]) == (400, "bad_submission")

    # late: the window closed, the contract refuses to file and the validator refuses to judge
    published.chain.advance_time(SETTINGS.appeal_window + 1)
    assert _chain_reason(lambda: published.operator.appeal(key)) == "AppealWindowClosed"
    late = _appeal(node.identity, node, key, verdict, submission)
    status, answer = _post(checker, node.identity, late)
    assert (status, answer["error"]) == (410, "appeal_window_closed")
    status, answer = _post(checker, node.identity, late)  # the same signed appeal again is a replay
    assert (status, answer["error"]) == (409, "replay")
    assert published.admin.get_escrow(key).status is EscrowStatus.HELD
    token = published.token()
    treasury = published.chain.account(TREASURY).address
    before = token.balance_of(treasury)
    published.stranger.release_escrow(key)  # anyone releases it to the treasury once the window is over
    assert token.balance_of(treasury) == before + SETTINGS.slash_penalty
    assert published.admin.get_escrow(key).status is EscrowStatus.RELEASED


@pytest.mark.slow  # ~5 s; the default tier keeps the won, lost, late and someone-else appeals
def test_a_validator_that_cannot_recheck_says_so_and_resolves_nothing(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    node = make_node()
    slasher = make_validator("a")
    with socket.socket() as s:  # a relay nobody runs: this validator never gets the weights of v1
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    trainer = published.trainer.identity.address
    blind = make_validator("b", account=second_validator,
                           weights={"type": "shardcast", "relays": [dead], "trainer": trainer})
    key, verdict, submission = _slashed(slasher, node, cheat="inflate_reward")
    published.operator.appeal(key)
    status, answer = _post(blind, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert (status, answer["error"]) == (503, "cannot_check"), answer
    assert "policy version 1" in answer["detail"]
    assert published.admin.get_escrow(key).status is EscrowStatus.APPEALED  # still open for another validator
    with blind.client() as c:
        assert c.get(f"/v1/appeals/{key}").status_code == 404


def test_work_restored_by_a_won_appeal_reaches_the_trainer(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    """Issue 23 item 13: an honest node slashed by a validator with absurdly strict thresholds (logprob tolerance
    0: honest decode and prefill differ by ~1e-6) wins its appeal at another validator. The restored work enters
    that validator's trainer feed (tokens, recomputed rewards, its replay's logprobs), a trainer pulling the feed
    over HTTP trains it, and the audit reconciles it as restored work that reached the trainer."""
    from bench.loopback import RUN
    from devnet.audit import Inputs, reconcile
    from protocol.rollout import Submission
    from trainer.validator_feed import ValidatorFeedSource

    node = make_node()
    strict = make_validator("a", checks={"logprob_tolerance": 0.0})
    fair = make_validator("b", account=second_validator)
    key, verdict, submission = _slashed(strict, node)  # honest work
    published.operator.appeal(key)
    status, answer = _post(fair, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert status == 200 and answer["outcome"] == "overturned" and answer["resolved"], answer
    assert published.admin.get_work(key).status is WorkStatus.ACCEPTED

    with fair.client() as c:
        audit = c.get("/v1/audit").json()
    (restored,) = audit["restored"]
    assert (restored["work_key"], restored["node"], restored["resolved"]) == (key, node.identity.address, True)
    assert restored["feed_seq"] == 1 and audit["feed_size"] == 1

    sub = Submission.model_validate(Envelope.model_validate_json(submission).body)
    src = ValidatorFeedSource([fair.url], fair.service.domain, addresses=[fair.service.identity.address],
                              run_id=RUN.run_id, poll_interval_s=0.05, wait_timeout_s=30)
    try:
        batch = src.next_batch(1, len(sub.tasks), RUN.async_level)
        cursors = src.cursors()
    finally:
        src.close()
    assert batch.work == {"trained": [key]}
    claims = [s for tr in sub.tasks for s in tr.samples]
    assert [s.tokens[-len(c.tokens):] for s, c in zip(batch.samples, claims, strict=True)] == [c.tokens for c in claims]
    assert [s.reward for s in batch.samples] == [c.reward for c in claims]
    fed = [tuple(lp for lp, m in zip(s.sampling_logprobs, s.loss_mask, strict=True) if m) for s in batch.samples]
    loaded = fair.service.weights.get(sub.policy_version)
    (reports,) = fair.service.core.checker.measure(loaded, [(sub, fair.service.core.assignment.tasks(
        sub.node, sub.policy_version, sub.counter))])
    assert fed == [tuple(r.logprobs) for r in reports]  # the resolver's replay, not the node's claim

    reports_by_name = {}
    for name, v in (("a", strict), ("b", fair)):
        with v.client() as c:
            reports_by_name[name] = {**c.get("/v1/audit").json(), "url": v.url}
    events = [{"name": "WorkRestored", "args": {"workKey": bytes.fromhex(key[2:]), "reward": 0}}]
    steps = {1: {"step": 1, "trained": batch.work["trained"], "stale": [], "future": [], "cursors": cursors,
                 "queued": []}}
    rows = reconcile(Inputs(validators=reports_by_name, trainer_steps=steps, nodes={}, chain_events=events,
                            rewards_reserved=0, reward_per_unit=1))
    fate = next(r for r in rows if r.check.startswith("accepted = trained"))
    assert fate.ok and fate.expected == "0 + 1 restored", fate
    assert next(r for r in rows if r.check == "trained work that no validator accepted").ok


def test_a_one_validator_pool_rechecks_appeals_of_its_own_verdicts(
        make_validator: Any, make_node: Any, published: Pools) -> None:
    """Issue 23 item 13: with a single validator in the pool an appeal is no longer stuck for want of a second one:
    the slasher re-checks its own verdict (same thresholds) and resolves it on chain."""
    assert published.admin.validator_count() == 1
    node = make_node()
    only = make_validator("a")
    key, verdict, submission = _slashed(only, node, cheat="inflate_reward")
    published.operator.appeal(key)
    status, answer = _post(only, node.identity, _appeal(node.identity, node, key, verdict, submission))
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"]) == ("upheld", "reward_mismatch") and answer["resolved"]
    assert published.admin.get_escrow(key).status is EscrowStatus.UPHELD


def _equivocation(v: Any, node: SimNode, published: Pools) -> tuple[str, str, dict[str, Any], bytes]:
    """(work key, verdict, row, evidence bytes) of an assignment `node`'s key signed twice, slashed by `v`."""
    import time

    _, first = node.build(counter=0)
    _, second = node.build(counter=0, cheat="inflate_reward")  # another payload for the same assignment
    with v.client() as c:
        r = c.post("/v1/submissions", content=first)
        assert r.status_code in (200, 202), r.text
        key = str(r.json()["work_key"])
        r = c.post("/v1/submissions", content=second)
        assert (r.status_code, r.json()["error"]) == (409, "duplicate_work"), r.text
    deadline = time.monotonic() + 60
    while published.admin.get_work(key).status is not WorkStatus.HARD_INVALIDATED:
        assert time.monotonic() < deadline, "the equivocation slash did not land"
        time.sleep(0.2)
    with v.client() as c:
        row = dict(c.get(f"/v1/submissions/{key}").json())
        assert row["reason"] == "equivocation", row
        evidence = c.get(f"/v1/evidence/{row['evidence_hash']}").content
    return key, str(row["verdict"]), row, evidence


def test_an_equivocation_verdict_is_rechecked_from_its_own_evidence(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    """Issue 23 item 13: an equivocation verdict's evidence holds both envelopes the key signed, so another
    validator re-checks it alone (signatures, same assignment, different payloads) instead of `cannot_check`;
    evidence that is not the document the verdict committed to is refused."""
    import json

    node = make_node()
    slasher = make_validator("a")
    checker = make_validator("b", account=second_validator)
    key, verdict, row, evidence = _equivocation(slasher, node, published)
    doc = json.loads(evidence)
    judged = doc["submission"].encode()  # the envelope the verdict judged (the second one)
    published.operator.appeal(key)

    def appeal(evidence_text: str | None) -> bytes:
        body = Appeal(run_id=node.run.run_id, node=node.identity.address, work_key=bytes.fromhex(key[2:]),
                      verdict=verdict, submission=judged.decode(), evidence=evidence_text)
        return seal(node.identity, body, domain=node.domain, nonce=random_nonce()).to_bytes()

    status, answer = _post(checker, node.identity, appeal(None))
    assert (status, answer["error"]) == (400, "bad_evidence")
    tampered = json.dumps({**doc, "first": doc["submission"]}, sort_keys=True, separators=(",", ":"))
    status, answer = _post(checker, node.identity, appeal(tampered))
    assert (status, answer["error"]) == (400, "bad_evidence")
    status, answer = _post(checker, node.identity, appeal(evidence.decode()))
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"], answer["original_reason"]) == ("upheld", "equivocation",
                                                                              "equivocation")
    assert answer["resolved"] and published.admin.get_escrow(key).status is EscrowStatus.UPHELD


def test_an_equivocation_its_evidence_does_not_prove_is_rechecked_in_full(
        make_validator: Any, make_node: Any, published: Pools, second_validator: int) -> None:
    """An equivocation verdict whose own (committed) evidence holds the same envelope twice proves nothing: the
    judged submission then goes through the full re-check (here honest work: overturned), so an overturned
    equivocation never restores work nobody checked."""
    import hashlib

    from chainfixtures import VALIDATOR

    from protocol.canonical import canonical_bytes
    from protocol.rollout import Outcome, Reason, Verdict, submission_hash

    node = make_node()
    checker = make_validator("b", account=second_validator)
    slasher = published.chain.account(VALIDATOR)  # a validator key that "slashes" without a running service
    sub, data = node.build()
    evidence = canonical_bytes({"reason": "equivocation", "first": data.decode(), "submission": data.decode()})
    evidence_hash = hashlib.sha256(evidence).digest()
    key = published.work_key(sub.run_id, sub.node, sub.policy_version, sub.counter)
    verdict = seal(slasher, Verdict(run_id=sub.run_id, work_key=key, node=sub.node, policy_version=sub.policy_version,
                                    counter=sub.counter, submission_hash=submission_hash(data),
                                    outcome=Outcome.REJECTED_HARD, reason=Reason.EQUIVOCATION,
                                    evidence_hash=evidence_hash),
                   domain=node.domain, nonce=random_nonce()).to_bytes().decode()
    published.validator.invalidate_hard(sub.node, key, Reason.EQUIVOCATION.code, evidence_hash)
    published.operator.appeal(key)
    body = Appeal(run_id=sub.run_id, node=sub.node, work_key=key, verdict=verdict, submission=data.decode(),
                  evidence=evidence.decode())
    status, answer = _post(checker, node.identity,
                           seal(node.identity, body, domain=node.domain, nonce=random_nonce()).to_bytes())
    assert status == 200, answer
    assert (answer["outcome"], answer["original_reason"]) == ("overturned", "equivocation"), answer
    assert answer["measurements"]["samples"]  # the model re-checked the work
    assert published.admin.get_escrow(key).status is EscrowStatus.OVERTURNED
