"""A validator covering for a down peer, against anvil (issue 35 items 4 and 7): it continues a node's counters from
what the pool knows (the chain's frontier for that node and version), never from a first counter the node picks; a
chain it cannot read meanwhile is its own failure, a retry, never a verdict or a refusal held against the node; and a
node that splits one assignment's payloads between the two is slashed once either sees the other's record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from chainfixtures import STRANGER, VALIDATOR, Pools
from netfixtures import ProxyProcess

from bench.adversaries import SimNode, steer_logprobs
from bench.loopback import REPORTER_MAX_BACKOFF_S, RUN, Served, serve, validator_config
from contracts.pool import NodeStatus, WorkStatus
from protocol.seeds import validator_ranking

pytestmark = pytest.mark.timeout(300)


def _post(v: Served, data: bytes) -> httpx.Response:
    with v.client() as c:
        return c.post("/v1/submissions", content=data)


def _cast(published: Pools, make_node: Any) -> tuple[str, str, SimNode, str, str, dict[str, int]]:
    """Validators a and b (STRANGER's account gets the role), a registered node, its first and second validator at
    v1, and the dev account of each validator address."""
    a, b = published.chain.account(VALIDATOR).address, published.chain.account(STRANGER).address
    published.admin.grant_role("validator", b)
    node: SimNode = make_node()
    first, second = validator_ranking(RUN.run_id, node.identity.address, 1, [a, b])
    return a, b, node, first, second, {a: VALIDATOR, b: STRANGER}


def test_a_covering_validator_continues_from_the_chains_frontier_and_a_dead_chain_is_its_own_failure(
        published: Pools, deployment_file: Path, make_validator: Any, make_node: Any, tmp_path: Path) -> None:
    a, b, node, first, second, account = _cast(published, make_node)
    address = node.identity.address
    assigned = make_validator("first", account=account[first], validators=[a, b])
    chain = ProxyProcess(urlparse(published.chain.rpc_url).port or 0)  # the backup reads the chain through it
    backup = serve(validator_config(tmp_path / "second", deployment_file, chain.url, validators=[a, b],
                                    peers=[assigned.url], failover_after_s=0.5), published.chain.account(account[second]))
    try:
        # the assigned validator took counters 0..2 and reported them (the pool has their work keys), then dies
        published.validator.record_work_batch([(address, published.work_key(RUN.run_id, address, 1, c), 1)
                                               for c in range(3)])
        assigned.stop()
        deadline = time.monotonic() + 60
        while not backup.service.peers.down(first):
            assert time.monotonic() < deadline, backup.service.peers.peers[0].error
            time.sleep(0.1)

        # a hand-picked first counter (one whose tasks the node liked): refused, no row, the frontier is 3
        r = _post(backup, node.build(counter=228)[1])
        assert (r.status_code, r.json()["error"], r.json()["expected_counter"]) == (409, "counter_out_of_order", 3)
        assert backup.service.ledger.get("0x" + published.work_key(RUN.run_id, address, 1, 228).hex()) is None
        r = _post(backup, node.build(counter=3)[1])
        assert r.status_code == 202, r.json()

        # the chain stops answering: the frontier cannot be read, so the next submission is answered with a
        # retry (503 + Retry-After), recorded nowhere and held against no one; its nonce is not spent, so the
        # very same envelope is taken once the chain answers again
        _, data = node.build(counter=4)
        chain.close()
        r = _post(backup, data)
        assert (r.status_code, r.json()["error"]) == (503, "chain_unavailable"), r.json()
        assert int(r.headers["Retry-After"]) >= 1
        key = "0x" + published.work_key(RUN.run_id, address, 1, 4).hex()
        assert backup.service.ledger.get(key) is None
        assert backup.service.ledger.node_summary(address)["refused"] == {"counter_out_of_order": 1}
        chain = ProxyProcess(urlparse(published.chain.rpc_url).port or 0, port=chain.port)
        r = _post(backup, data)
        assert r.status_code == 202 and r.json()["work_key"] == key, r.json()
    finally:
        backup.stop()
        chain.close()


def _outcome(v: Served, key: str) -> str | None:
    row = v.service.ledger.get(key)
    return None if row is None else row.outcome


def _wait(what: Any, why: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def test_a_node_that_splits_one_assignment_between_its_validator_and_the_one_covering_is_slashed(
        published: Pools, deployment_file: Path, make_validator: Any, make_node: Any, tmp_path: Path) -> None:
    """Issue 35 item 7: payload P1 to the assigned validator A (accepted, not reported yet), then, once A looks down
    to its peer B, a different payload P2 for the same assignment to B, which covers and records it. A reads B's
    `WorkRecorded`, fetches B's envelope and judges its own row an equivocation with both envelopes as evidence;
    its hard invalidation of the key B recorded slashes the node. The same payload sealed again and sent to B (a
    retry that failed over) is no equivocation."""
    a, b, node, first, second, account = _cast(published, make_node)
    address = node.identity.address
    to_first = ProxyProcess(None)  # B reaches A only through it: closed, A is down for B and for no one else
    backup = serve(validator_config(tmp_path / "second", deployment_file, published.chain.rpc_url, validators=[a, b],
                                    peers=[to_first.url], failover_after_s=0.5), published.chain.account(account[second]))
    try:
        # A reports only when the test drains it: its acceptance of P1 stays off chain, as when it went down
        assigned = make_validator("first", account=account[first], validators=[a, b], peers=[backup.url],
                                  reporter={"interval_s": 3600.0, "max_backoff_s": REPORTER_MAX_BACKOFF_S},
                                  pool_notes={"crosscheck_s": 0.2})
        to_first.forward_to(urlparse(assigned.url).port or 0)  # A listens (on a port it bound itself)
        _wait(lambda: second in assigned.service.peers.urls(), "A never identified B")
        split, retried = node.build(counter=0), node.build(counter=1)
        keys = ["0x" + published.work_key(RUN.run_id, address, 1, c).hex() for c in (0, 1)]
        for _, data in (split, retried):
            assert _post(assigned, data).status_code == 202
        _wait(lambda: all(_outcome(assigned, k) == "accepted" for k in keys), "A never accepted the node's work")

        to_first.close()
        _wait(lambda: backup.service.peers.down(first), "B never saw A down")
        other = steer_logprobs(split[0])  # the same assignment, a different payload that passes every check
        assert other != split[0]
        r = _post(backup, node.seal(other))
        assert r.status_code == 202, r.json()
        r = _post(backup, node.seal(retried[0]))  # the very payload A holds, sealed again with a fresh nonce
        assert r.status_code == 202, r.json()
        _wait(lambda: all(published.validator.get_work(k).status is WorkStatus.ACCEPTED for k in keys),
              "B never recorded the work it covered")

        # A compares: the split is an equivocation, proved by both envelopes; the retry is nothing
        _wait(lambda: _outcome(assigned, keys[0]) == "rejected_hard", "A never judged the split")
        _wait(lambda: assigned.service.core.stats.get("crosscheck_same"), "A never compared the retried payload")
        assert assigned.service.crosscheck is not None
        assert all(assigned.service.crosscheck.judged(k) for k in keys) and not assigned.service.crosscheck.judged("0x")
        row = assigned.service.ledger.get(keys[0])
        assert row is not None and row.reason == "equivocation", row
        evidence = json.loads(assigned.service.ledger.evidence(str(row.evidence_hash)) or b"{}")
        covered = backup.service.ledger.get(keys[0])
        assert covered is not None
        assert {evidence["first"].encode(), evidence["submission"].encode()} == {split[1], covered.envelope}
        kept = assigned.service.ledger.get(keys[1])
        assert kept is not None and kept.outcome == "accepted"

        # A reports: the key B recorded is invalidated and the node slashed and ejected
        _wait(lambda: assigned.service.reporter.drain() >= 0 and
              published.validator.get_work(keys[0]).status is WorkStatus.HARD_INVALIDATED, "A's slash never landed")
        assert published.validator.get_node(address).status is NodeStatus.EJECTED
        assert published.validator.get_work(keys[1]).status is WorkStatus.ACCEPTED
    finally:
        backup.stop()
        to_first.close()
