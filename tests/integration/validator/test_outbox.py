"""The chain reporter against a real anvil and a real validator: a verdict the chain refuses for good leaves
the outbox with its reason and a metric, and never holds up the verdicts behind it (issue 23 item 2)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
from chainfixtures import SETTINGS

from bench.loopback import REPORTER_MAX_BACKOFF_S
from contracts.pool import WorkStatus

pytestmark = pytest.mark.timeout(300)


def _wait_state(v: Any, key: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
    with v.client() as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = c.get(f"/v1/submissions/{key}").json()
            if row["state"] == state:
                return dict(row)
            time.sleep(0.1)
    raise AssertionError(f"{key} not {state} within {timeout} s: {row}")


def test_resigned_old_work_that_can_never_be_slashed_does_not_block_reporting(make_validator, make_node, published):
    attacker, honest, cheater = make_node(), make_node(), make_node()
    # batch 1: the old reporter read 10 rows a round, so 10 stuck rows at the head blocked everything
    v = make_validator(reporter={"interval_s": 0.2, "batch": 1, "max_backoff_s": REPORTER_MAX_BACKOFF_S}, audit_cache_s=0.0,
                       systemic={"window_s": 0.3, "min_nodes": 100, "fraction": 1.0})
    built = [attacker.build() for _ in range(10)]
    old_keys = [v.post_work(data) for _, data in built]
    for key in old_keys:
        assert v.wait_reported(key)["outcome"] == "accepted"
        assert published.admin.get_work(key).status == WorkStatus.ACCEPTED
    # the invalidation window of that work closes: invalidateHard of it reverts, now and forever
    published.chain.rpc("evm_increaseTime", [SETTINGS.invalidation_window + 10])
    published.chain.rpc("evm_mine")
    with v.client() as c:
        for sub, _ in built:  # a different payload re-signed for each recorded assignment: equivocation
            first = sub.tasks[0].samples[0]
            other = sub.model_copy(update={"tasks": (sub.tasks[0].model_copy(update={"samples": (
                first.model_copy(update={"reward": first.reward + 1.0}), *sub.tasks[0].samples[1:])}),
                *sub.tasks[1:])})
            r = c.post("/v1/submissions", content=attacker.seal(other))
            # 409: an equivocation verdict; 429: the node is held back while a hard verdict of it is pending
            assert r.status_code in (409, 429), r.text
    # work submitted afterwards is still recorded, and other slashes still land
    honest_key = v.post_work(honest.build()[1])
    bad_key = v.post_work(cheater.build(cheat="other_seed")[1])
    assert v.wait_reported(honest_key)["outcome"] == "accepted"
    assert published.admin.get_work(honest_key).status == WorkStatus.ACCEPTED
    bad = v.wait_reported(bad_key)
    assert (bad["outcome"], bad["reason"]) == ("rejected_hard", "sampling_mismatch")
    assert published.admin.get_work(bad_key).status == WorkStatus.HARD_INVALIDATED
    stuck = _wait_state(v, old_keys[0], "unreportable")
    assert (stuck["outcome"], stuck["reason"]) == ("rejected_hard", "equivocation")
    assert "InvalidationWindowClosed" in stuck["report_error"]
    assert stuck["chain_tx"] is None and stuck["evidence_hash"]  # the verdict and its evidence stay here
    assert published.admin.get_work(old_keys[0]).status == WorkStatus.ACCEPTED
    with v.client() as c:
        metrics = c.get("/metrics").text
        assert 'prime_validator_unreportable{reason="InvalidationWindowClosed"}' in metrics
        deadline = time.monotonic() + 30
        while True:  # read while nothing moves (a late re-signed row may still be on its way out)
            audit = c.get("/v1/audit").json()
            counts = c.get("/v1/audit?rows=false").json()
            metrics_after = c.get("/metrics").text
            if c.get("/v1/audit").json() == audit or time.monotonic() > deadline:
                break
    # the counts dashboards poll come from running tallies (no listing, no scan) and match the full scan
    assert "rejected_hard" not in counts and counts["counts"] == audit["counts"]
    assert counts["feed_size"] == audit["feed_size"] == len(audit["accepted"])
    hard_rows = len(audit["rejected_hard"])
    assert f'prime_validator_ledger_rows{{kind="outcome:rejected_hard"}} {float(hard_rows)}' in metrics_after
    assert f'prime_validator_feed_items {float(audit["feed_size"])}' in metrics_after
    listed = {h["work_key"]: h for h in audit["rejected_hard"]}
    assert listed[old_keys[0]]["reported"] is False
    assert "InvalidationWindowClosed" in listed[old_keys[0]]["unreportable"]
    assert audit["counts"]["unreportable"] >= 1


def test_the_rpc_failing_pauses_reporting_with_backoff_and_blames_no_row(published, tmp_path):
    """A transient failure (the RPC unreachable) says nothing about the rows: none is deferred or given up,
    the reporter waits (doubling) and then records them once the chain answers again."""
    from chainfixtures import VALIDATOR
    from netfixtures import free_port

    from contracts.pool import PoolClient
    from contracts.transactor import Transactor, connect
    from validator.ledger import Decision, Ledger
    from validator.reporter import Reporter

    node = published.new_node()
    ledger = Ledger.open(path=tmp_path / "ledger.sqlite")
    key = "0x" + "ab" * 32
    ledger.insert(work_key=key, submission_hash="0x" + "cd" * 32, node=node.address, policy_version=1, counter=0,
                  envelope=b"{}", decision=Decision(outcome="accepted", reason="accepted", measurements={"units": 3}))
    me = published.chain.account(VALIDATOR)
    dead = f"http://127.0.0.1:{free_port()}"
    down = PoolClient(connect(dead), published.deployment.pool, me, Transactor(connect(dead), me, retries=0))
    reporter = Reporter(ledger, down, batch=4, hold_hard_s=0.0, retry_backoff_s=10.0, max_backoff_s=25.0)
    t = time.time()
    assert reporter.drain(now=t) == 0
    assert reporter.paused_until == t + 10.0
    assert reporter.drain(now=t + 5.0) == 0  # paused: not even tried
    assert reporter.drain(now=t + 10.0) == 0 and reporter.paused_until == t + 30.0  # doubled
    assert reporter.drain(now=t + 30.0) == 0 and reporter.paused_until == t + 55.0  # at most max_backoff_s
    row = ledger.get(key)
    assert row is not None and (row.state, row.report_error) == ("decided", None)  # no row blamed
    assert reporter.deferred == 0 and not reporter.unreportable
    reporter.pool = PoolClient(connect(published.chain.rpc_url), published.deployment.pool, me)  # the RPC is back
    assert reporter.drain(now=t + 55.0) == 1
    assert published.admin.get_work(key).status == WorkStatus.ACCEPTED
    assert reporter.paused_until == t + 55.0 and reporter.drain(now=t + 56.0) == 0  # nothing left, no pause
    ledger.close()


def test_soft_invalidations_go_on_chain_in_one_batch(published, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 3: stale rows (an older ledger's: intake refuses stale work without a row now) are invalidated
    on chain by one `invalidateSoftBatch` per batch, not one `invalidateSoft` each; a key already invalidated
    is skipped, and a batch that reverts goes row by row so the one bad row is set aside."""
    from validator.ledger import Decision, Ledger
    from validator.reporter import Reporter

    node = published.new_node()
    other = published.new_node()
    ledger = Ledger.open(path=tmp_path / "ledger.sqlite")
    stale = Decision(outcome="rejected_soft", reason="stale_version", verdict=b"v")

    def row(i: int, owner: str = node.address) -> str:
        key = "0x" + hashlib.sha256(f"stale-{i}".encode()).hexdigest()
        ledger.insert(work_key=key, submission_hash=f"h{i}", node=owner, policy_version=1, counter=i,
                      envelope=b"{}", decision=stale)
        return key

    keys = [row(i) for i in range(6)]
    published.validator.invalidate_soft(node.address, keys[0], 1)  # already on chain (a receipt lost, say)
    reporter = Reporter(ledger, published.validator, batch=64, hold_hard_s=0.0)
    before = published.chain.rpc("eth_blockNumber")
    assert reporter.drain() == 6
    assert int(published.chain.rpc("eth_blockNumber"), 16) - int(before, 16) == 1  # one transaction for six rows
    assert all(published.admin.get_work(k).status == WorkStatus.SOFT_INVALIDATED for k in keys)
    assert {r.state for r in map(ledger.get, keys) if r is not None} == {"reported"}
    # another node's recorded work under a stale row's key reverts the batch: the rest still land
    taken = row(100, owner=node.address)
    published.validator.record_work(other.address, taken, 5)
    more = [row(i) for i in range(6, 9)]
    assert reporter.drain() == 3
    assert all(published.admin.get_work(k).status == WorkStatus.SOFT_INVALIDATED for k in more)
    bad = ledger.get(taken)
    assert bad is not None and bad.state == "unreportable" and "WorkOfOtherNode" in (bad.report_error or "")


def test_envelopes_are_pruned_once_the_invalidation_window_passed(make_validator, make_node, published) -> None:
    """Issue 35 item 3: a stored envelope leaves the disk once the chain can no longer change its verdict (the
    invalidation window after it was reported); a hard verdict keeps its envelope (its evidence names it), and a
    pruned assignment sent again is a duplicate, never a crash or a second row."""
    honest, cheater = make_node(), make_node()
    v = make_validator(reporter={"interval_s": 0.2, "max_backoff_s": REPORTER_MAX_BACKOFF_S}, systemic={"window_s": 0.3, "min_nodes": 100, "fraction": 1.0})
    sub, data = honest.build()
    ok_key, bad_key = v.post_work(data), v.post_work(cheater.build(cheat="inflate_reward")[1])
    ok, bad = v.wait_reported(ok_key), v.wait_reported(bad_key)
    assert (ok["outcome"], bad["outcome"]) == ("accepted", "rejected_hard")
    window = published.admin.params().invalidation_window
    assert v.service.chain.invalidation_window == window
    assert v.service.prune_envelopes() == 0  # inside the window: kept
    assert v.service.prune_envelopes(now=time.time() + window + 2 * 3600) == 1
    ledger = v.service.ledger
    assert ledger.get(ok_key).envelope == b"" and ledger.get(bad_key).envelope  # type: ignore[union-attr]
    with v.client() as c:
        assert c.get(f"/v1/envelopes/{ok['submission_hash']}").status_code == 404
        assert c.get(f"/v1/envelopes/{bad['submission_hash']}").status_code == 200
        again = c.post("/v1/submissions", content=honest.seal(sub))  # the same payload sealed again
        assert again.status_code == 409 and again.json()["work_key"] == ok_key, again.text
        assert c.get(f"/v1/submissions/{ok_key}").json()["outcome"] == "accepted"
    assert ledger.counts()["outcome:accepted"] == 1


def test_hard_invalidations_go_on_chain_in_one_batch(published, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 35 item 3: hard verdicts waiting in the outbox go by one `invalidateHardBatch` per batch, each slashed
    and escrowed as by `invalidateHard`; a key already slashed (a receipt lost) is skipped."""
    from validator.ledger import Decision, Ledger
    from validator.reporter import Reporter

    nodes = [published.new_node() for _ in range(3)]
    ledger = Ledger.open(path=tmp_path / "ledger.sqlite")
    keys = []
    for i, node in enumerate(nodes):
        key = "0x" + hashlib.sha256(f"hard-{i}".encode()).hexdigest()
        evidence = f"evidence {i}".encode()
        ledger.insert(work_key=key, submission_hash=f"h{i}", node=node.address, policy_version=1, counter=0,
                      envelope=b"{}", decision=Decision(outcome="rejected_hard", reason="reward_mismatch", verdict=b"v",
                                                        evidence=evidence,
                                                        evidence_hash="0x" + hashlib.sha256(evidence).hexdigest()))
        keys.append(key)
    published.validator.invalidate_hard(nodes[0].address, keys[0], 1, "0x" + "11" * 32)  # already on chain
    reporter = Reporter(ledger, published.validator, batch=64, hold_hard_s=0.0)
    before = int(published.chain.rpc("eth_blockNumber"), 16)
    assert reporter.drain() == 3
    assert int(published.chain.rpc("eth_blockNumber"), 16) - before == 1  # one transaction for three slashes
    stake = published.admin.params().min_stake - published.admin.params().slash_penalty
    for node, key in zip(nodes, keys, strict=True):
        assert published.admin.get_work(key).status == WorkStatus.HARD_INVALIDATED
        assert published.admin.get_node(node.address).stake == stake  # slashed once, the skipped key too
