"""EOS near-ties against a real validator and anvil (issue 23 item 9): a node that replaces every EOS that won
the seeded draw narrowly (within the sampling margin) and keeps generating is caught as `termination` and slashed;
honest work passes and is paid for its tokens."""

from __future__ import annotations

import time
from typing import Any

from validator_harness import RUN, SimNode, narrow_eos_node

from contracts.pool import WorkStatus


def _post(v: Any, data: bytes) -> str:
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code in (200, 202), r.text
        return str(r.json()["work_key"])


def test_a_node_that_skips_every_narrow_eos_is_caught_and_honest_work_passes(make_validator, make_node, published,
                                                                             tiny_model):
    v = make_validator()
    drift = v.service.cfg.checks.eos_tie_drift
    key = narrow_eos_node(tiny_model, RUN, 1, above=drift, domain=make_node(register=False).domain)
    published.operator.register(key, published.admin.params().min_stake)
    deadline = time.monotonic() + 30
    while not v.service.chain.node_active(key.address):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cheater = SimNode(key, tiny_model, make_node(register=False).domain)
    sub, data = cheater.build(cheat="skip_eos")
    bad = _post(v, data)
    honest = [make_node() for _ in range(2)]
    good = [_post(v, n.build()[1]) for n in honest]

    row = v.wait_reported(bad)
    assert (row["outcome"], row["reason"]) == ("rejected_hard", "termination"), (row["reason"], row["detail"])
    samples = row["measurements"]["samples"]
    skipped = [s for s in samples if s["eos_skips"]]
    assert skipped and all(drift < m <= 0.5 for s in skipped for _, m in s["eos_near_ties"])
    assert not any(s["sampling_mismatches"] for s in samples)  # every skip was inside the sampling margin
    assert row["measurements"]["units"] < sub.n_tokens()  # nothing after the replay's EOS would be paid
    assert published.admin.get_work(bad).status == WorkStatus.HARD_INVALIDATED
    for k in good:
        ok = v.wait_reported(k)
        assert ok["outcome"] == "accepted", (ok["reason"], ok["detail"])
        assert ok["measurements"]["eos_near_ties"] == 0
