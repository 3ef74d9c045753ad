"""prime-node's counters against a real validator and anvil (issue 23 item 6): the node sends them in order,
and when its validator expects a counter this node no longer holds it waits for the next version instead of
stopping or signing counters that validator will not take."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from test_node_join import make_worker, node_config, start_loop

from bench.loopback import MANIFEST_V0, RUN, TINY
from node import commands
from node.protection import FORMAT, SlashingProtection
from protocol.canonical import to_hex

pytestmark = pytest.mark.timeout(300)


def _wait(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_node_refused_for_an_earlier_counter_waits_for_the_next_version(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    served = make_validator()
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url], run=RUN, model=TINY,
                      max_batches=None)
    chain = commands.open_chain(cfg)
    failure: list[BaseException] = []
    with httpx.Client(timeout=30) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        # counters 0 and 1 at v1 were signed on another machine (imported records, no payload): this node goes
        # on at 2, which the validator does not take before 0 (its gap is 1)
        db.import_({"metadata": {"interchange_format": FORMAT, "interchange_format_version": "1"},
                    "data": [{"node": node.address, "run_id": RUN.run_id,
                              "signed": [{"policy_version": "1", "counter": str(c), "payload_hash": "0x" + "11" * 32}
                                         for c in (0, 1)]}]})
        worker = make_worker(cfg, node, chain, db, http, [served.url])

        thread = start_loop(worker, failure)
        try:
            _wait(lambda: (r := db.get(RUN.run_id, node.address, 1, 2)) is not None and r.state == "refused",
                  f"v1 #2 not refused: {failure}")
            _wait(lambda: "next version" in worker.tally.detail, f"not waiting: {worker.tally.detail} {failure}")
            assert thread.is_alive() and not failure, failure
            assert worker.tally.rejected["counter_out_of_order"] == 1
            assert db.next_counter(RUN.run_id, node.address, 1) == 3  # #2 is never signed again
            assert served.service.ledger.node_summary(node.address)["refused"] == {"counter_out_of_order": 1}
            # the next version: the node works there, from counter 0
            published.trainer.publish_policy(2, MANIFEST_V0)
            key = to_hex(published.work_key(RUN.run_id, node.address, 2, 0))
            assert served.wait_decided(key, timeout=120)["outcome"] == "accepted"
            assert db.get(RUN.run_id, node.address, 1, 3) is None  # nothing more signed at v1
        finally:
            worker.stop()
            thread.join(timeout=60)
    assert not failure, failure


def test_stale_work_refused_by_the_validator_is_dropped_not_resent(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path, tiny_model: Any) -> None:
    """Issue 35 item 3: the validator refuses stale work with 410 and no row; the node drops that assignment for
    good (`refused` in its protection database, never resent) instead of backing off from the validator."""
    from bench.adversaries import SimNode
    from protocol.rollout import submission_domain

    served = make_validator()
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [served.url], run=RUN, model=TINY)
    chain = commands.open_chain(cfg)
    domain = submission_domain(published.deployment.chain_id, published.deployment.pool, RUN.run_id)
    sub, _ = SimNode(node, tiny_model, domain).build(version=1, counter=0)
    published.trainer.publish_policy(2, MANIFEST_V0)
    published.trainer.publish_policy(3, MANIFEST_V0)  # async level 1: v1 is stale now
    _wait(lambda: served.service.chain.current_version() == 3, "v3 not seen")
    with httpx.Client(timeout=30) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [served.url])
        answer = worker.submit(sub)
        assert answer.get("error") == "stale_version", answer
        record = db.get(RUN.run_id, node.address, 1, 0)
        assert record is not None and record.state == "refused"
        assert worker.tally.peer_errors == {"stale_version": 1}
        assert worker.resend_unsent()  # nothing left to resend
    assert served.service.ledger.node_summary(node.address)["refused"] == {"stale_version": 1}
