"""Per-node totals that survive a restart (issue 35 item 3): the bytes one staked key has stored at a validator
are counted in the ledger, not only per window in memory, so restarting the validator does not hand the key a
fresh allowance."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)

FAST = {"rate_per_node": 1000.0, "rate_burst": 1000}  # the per-node rate limit out of the way


def _cheap_failures(node: Any, n: int) -> list[bytes]:
    """`n` distinct submissions of `node` that fail a cheap check (wrong tasks) at intake, one generation."""
    sub, _ = node.build(counter=0, cheat="unassigned_task")
    return [node.seal(sub.model_copy(update={"counter": i})) for i in range(n)]


def test_a_nodes_stored_bytes_are_a_total_that_survives_a_restart(make_validator, make_node):
    flooder, other = make_node(), make_node()
    floods = _cheap_failures(flooder, 8)
    size = max(len(d) for d in floods)
    flood = {"node_stored_bytes": 3 * size + size // 2, "window_s": 1.0, "hold_slashable": False}
    # the hard verdicts wait out a long systemic window: reported (and slashed) during the test, they would make the
    # node inactive, refused 403 before its stored bytes are looked at (a race the restart lost on a busy box)
    slow = {"window_s": 60.0, "min_nodes": 100, "fraction": 1.0}
    v = make_validator(**FAST, flood=flood, systemic=slow)
    with v.client() as c:
        codes = [c.post("/v1/submissions", content=data).status_code for data in floods[:5]]
    assert codes == [200, 200, 200, 429, 429], codes
    assert v.service.ledger.node_stored_bytes(flooder.identity.address) == sum(len(d) for d in floods[:3])
    v.stop()
    again = make_validator(**FAST, flood=flood, systemic=slow)  # the same state directory: a restart
    with again.client() as c:
        r = c.post("/v1/submissions", content=floods[5])
        assert r.status_code == 429 and r.json()["error"] == "node_quota", r.text
        assert c.post("/v1/submissions", content=_cheap_failures(other, 1)[0]).status_code == 200
