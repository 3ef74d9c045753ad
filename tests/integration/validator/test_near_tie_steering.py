"""Near-tie steering against a real validator and anvil (issue 35 item 5): a node that, at every position where
another token scores within the sampling tolerance of the seeded draw's winner, takes the one it prefers passes
every per-token check, but its account of near-tie disagreements is far beyond an honest node's
(`validator.near_tie_rule`): it gets a hard `near_tie_steering` verdict whose evidence names the account, and is
slashed. Honest work from the same validator is accepted."""

from __future__ import annotations

import json
from typing import Any

import pytest
from chainfixtures import VALIDATOR2, Pools

from contracts.pool import EscrowStatus, WorkStatus
from protocol.appeal import Appeal
from protocol.envelope import seal
from protocol.nonce import random_nonce
from protocol.upload import upload_headers
from validator.near_tie_rule import ALPHA, beyond_honest

pytestmark = pytest.mark.timeout(300)


STEERED_SUBMISSIONS = 8
"""Submissions the steering node sends at most: one alone can sit under the tail at the default honest rate (the
tiny model's ~160 tokens a submission); the account crosses it within a few, and then the validator refuses the
node's next ones (429 `node_quota` while its hard verdict is not on chain, 403 `node_inactive` once the slash
took its stake: which one depends on how fast the reporter is on the box)."""


def _steer_until_slashed(v: Any, node: Any) -> tuple[str, bytes, dict[str, Any], list[dict[str, Any]]]:
    """(key, envelope, row) of the steering node's first submission judged `near_tie_steering`, and the rows of
    those accepted before it. The model stage judges them in order, each against the account the ones before it
    left."""
    sent: list[bytes] = []
    keys: list[str] = []
    with v.client() as c:
        for _ in range(STEERED_SUBMISSIONS):
            data = node.build(cheat="steer_near_ties")[1]
            r = c.post("/v1/submissions", content=data)
            if (r.status_code, r.json().get("error")) in ((429, "node_quota"), (403, "node_inactive")):
                break  # its hard verdict is already in: held until it is on chain, or slashed out of the pool
            assert r.status_code in (200, 202), r.text
            sent.append(data)
            keys.append(str(r.json()["work_key"]))
    rows = [v.wait_reported(k) for k in keys]
    reasons = [r["reason"] for r in rows]
    assert "near_tie_steering" in reasons, [(r["reason"], r["detail"]) for r in rows]
    first = reasons.index("near_tie_steering")
    assert set(reasons[:first]) <= {"accepted"}, reasons
    return keys[first], sent[first], rows[first], rows[:first]


def test_a_node_that_steers_near_ties_is_slashed_with_its_account_and_honest_work_passes(make_validator, make_node,
                                                                                         published):
    v = make_validator()
    rate = v.service.cfg.checks.near_tie_honest_rate
    # The honest nodes register before anything is sent: once the steering node is slashed out, its refused posts
    # make the validator catch up with the chain, and a node registered within `CATCHUP_S` after that catch-up
    # is not in its view yet (403 `node_inactive`; CI run 29).
    honest = (make_node(), make_node())
    bad, _, row, before = _steer_until_slashed(v, make_node())
    good = [v.post_work(n.build()[1]) for n in honest]

    assert row["outcome"] == "rejected_hard", (row["reason"], row["detail"])
    samples = row["measurements"]["samples"]
    assert not any(s["sampling_mismatches"] for s in samples)  # every chosen token was within the tolerance
    near = [r["measurements"]["near_ties"] for r in [*before, row]]
    assert all(n > 0 for n in near)  # the tiny model leaves many near-ties, and the node took them
    with v.client() as c:
        evidence = json.loads(c.get(f"/v1/evidence/{row['evidence_hash']}").content)
    account = evidence["near_tie_account"]
    assert (account["honest_rate"], account["alpha"], account["near_ties"]) == (rate, ALPHA, sum(near))
    assert beyond_honest(account["tokens"], account["near_ties"], rate) and account["rows"][-1][0] == bad
    assert published.admin.get_work(bad).status == WorkStatus.HARD_INVALIDATED
    for k in good:
        ok = v.wait_reported(k)
        assert ok["outcome"] == "accepted", (ok["reason"], ok["detail"])
        assert not beyond_honest(ok["measurements"]["units"] or 1, ok["measurements"]["near_ties"], rate)


def test_an_appeal_of_a_steering_verdict_is_judged_on_the_slashers_account_and_upheld(make_validator, make_node,
                                                                                      published: Pools):
    """The judged submission alone passes every check: the appeal must carry the slasher's evidence (its account),
    and is upheld when that account is beyond the honest tail at the appeal validator's own rate."""
    published.admin.grant_role("validator", published.chain.account(VALIDATOR2).address)
    slasher, checker = make_validator("a"), make_validator("b", account=VALIDATOR2)
    node = make_node()
    key, data, row, _ = _steer_until_slashed(slasher, node)
    with slasher.client() as c:
        evidence = c.get(f"/v1/evidence/{row['evidence_hash']}").text
    published.operator.appeal(key)

    def appeal(carried: str | None) -> tuple[int, dict[str, Any]]:
        body = Appeal(run_id=node.run.run_id, node=node.identity.address, work_key=bytes.fromhex(key[2:]),
                      verdict=str(row["verdict"]), submission=data.decode(), evidence=carried)
        sealed = seal(node.identity, body, domain=node.domain, nonce=random_nonce()).to_bytes()
        headers = upload_headers(node.identity, sealed, domain=checker.service.domain,
                                 validator=checker.service.identity.address, path="/v1/appeals")
        with checker.client() as c:
            r = c.post("/v1/appeals", content=sealed, headers=headers)
            return r.status_code, dict(r.json())

    status, answer = appeal(None)
    assert status == 400 and "evidence" in json.dumps(answer), answer
    status, answer = appeal(evidence)
    assert status == 200, answer
    assert (answer["outcome"], answer["reason"]) == ("upheld", "near_tie_steering"), answer
    assert published.admin.get_escrow(key).status is EscrowStatus.UPHELD
