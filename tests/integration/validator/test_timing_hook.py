"""The validator's public timing hook (`validator.core.Core.timer`): what `bench/validator.py` reads instead of patching
private names, so a renamed stage fails here (and in the bench's smoke test), never silently."""

from __future__ import annotations

import pytest

from protocol.timing import StageTimer

pytestmark = pytest.mark.timeout(240)

INTAKE = {"intake.lookup", "intake.parse", "intake.open", "intake.gate", "intake.assignment",
          "intake.cheap_checks", "intake.insert", "intake.receipt"}
CHECK = {"check.ledger", "check.parse", "check.tasks", "check.rewards", "check.measure", "check.verdict",
         "verdict.seal", "measure.prefill", "measure.lm_head", "measure.toploc", "measure.sampling",
         "measure.termination", "measure.logprobs"}


def test_an_honest_submission_fills_every_documented_stage_and_nothing_else(make_validator, make_node):
    node = make_node()
    v = make_validator()
    timer = StageTimer()
    v.service.core.timer = timer
    _, data = node.build()
    with v.client() as c:
        r = c.post("/v1/submissions", content=data)
        assert r.status_code == 202, r.text
    row = v.wait_decided(r.json()["work_key"])
    assert row["outcome"] == "accepted", row
    assert set(timer.times) == INTAKE | CHECK
    assert timer.calls["intake.insert"] == 1 and timer.calls["check.verdict"] == 1
    assert timer.calls["measure.toploc"] == 4  # one per rollout (2 tasks x 2 samples)
    v.service.core.timer = None
    _, other = node.build()
    with v.client() as c:
        assert c.post("/v1/submissions", content=other).status_code == 202
    assert timer.calls["intake.insert"] == 1  # detached: nothing more recorded
