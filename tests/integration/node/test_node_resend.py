"""Work a validator took and never decided is sent again (issue 35 item 8): after `submit.verdict_deadline_s` with no
verdict the node resends the very envelope it sent. A validator that holds those bytes answers them as before (its
receipt, no second row, no replay or equivocation counted); one that lost them (here: the validator restarted on
an empty state dir, the same key and URL) takes them in and decides them; one that refuses them as too old gets the
same payload sealed afresh. Real validators and anvil on loopback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from test_node_join import make_worker, node_config

from bench.loopback import RUN, TINY
from node import commands
from node.protection import SlashingProtection
from node.rollouts import build_submission
from protocol.canonical import to_hex

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def submitted(published: Pools, deployment_file: Path, tmp_path: Path, url: str,
              verdict_deadline_s: float) -> Iterator[tuple[Any, Any, Any, SlashingProtection]]:
    """A node's worker that has sent assignment 0 of the current version to `url` and holds its receipt:
    (worker, node, policy, slashing-protection record)."""
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [url], run=RUN, model=TINY,
                      submit={"attempts": 3, "backoff_s": 0.05, "max_backoff_s": 0.2,
                              "verdict_deadline_s": verdict_deadline_s})
    chain = commands.open_chain(cfg)
    with httpx.Client(timeout=10) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [url])
        worker.validators.refresh()
        policy = worker.weights.select()
        sub = build_submission(policy.engine, RUN, node.address, policy.version, 0, policy.manifest_hash,
                               chain_id=worker.chain_id, pool=worker.pool)
        answer = worker.submit(sub)
        assert answer.get("receipt"), answer
        yield worker, node, policy, db


def test_work_without_a_verdict_is_resent_as_the_same_bytes(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    first = make_validator("first")
    port = int(first.url.rsplit(":", 1)[1])
    with submitted(published, deployment_file, tmp_path, first.url, 2.0) as (worker, node, policy, db):
        rec = db.get(RUN.run_id, node.address, policy.version, 0)
        assert rec is not None and rec.state == "submitted"
        sent = db.sent_hashes(RUN.run_id, node.address, policy.version, 0)
        assert len(sent) == 1

        # resent to the validator that holds it: the same answer and a receipt, nothing counted against the node
        assert worker.resend_overdue(now=time.time() + 3600) == 1
        assert db.sent_hashes(RUN.run_id, node.address, policy.version, 0) == sent  # the same bytes, not resealed
        assert not worker.tally.peer_errors and worker.validators.url_of(first.service.identity.address) == first.url
        summary = first.service.ledger.node_summary(node.address)
        assert not summary["refused"] and not summary["verdicts"].get("rejected_hard"), summary
        assert sum(n for k, n in first.service.ledger.counts().items() if k.startswith("state:")) == 1
        assert not any(k.startswith("refused_") for k in first.service.core.stats.snapshot()), \
            first.service.core.stats.snapshot()

        # the validator is lost before the node heard its verdict, and comes back on the same URL with nothing
        first.stop()
        make_validator("second", port=port)
        worker.wait_decided(120)
        rec = db.get(RUN.run_id, node.address, policy.version, 0)
        assert rec is not None and rec.state == "decided", rec
        assert worker.tally.accepted == 1 and worker.tally.resent >= 2


def test_a_resend_too_old_for_a_validator_new_to_it_is_sealed_afresh(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    max_age_s = 10.0
    first = make_validator("first")
    port = int(first.url.rsplit(":", 1)[1])
    with submitted(published, deployment_file, tmp_path, first.url, 1.0) as (worker, node, policy, db):
        sent = db.sent_hashes(RUN.run_id, node.address, policy.version, 0)
        last = db.last_sent(RUN.run_id, node.address, policy.version, 0)
        assert last is not None
        first.stop()
        while time.time() - last[1] <= max_age_s + 0.5:  # the envelope ages past what the new validator takes
            time.sleep(0.1)
        second = make_validator("second", port=port, max_age_s=max_age_s)
        worker.wait_decided(120)
        rec = db.get(RUN.run_id, node.address, policy.version, 0)
        assert rec is not None and rec.state == "decided", rec
        assert worker.tally.accepted == 1 and worker.tally.resent >= 1
        # the validator holds the payload sealed afresh (not the expired bytes), and no refusal beyond the expiry
        key = to_hex(published.work_key(RUN.run_id, node.address, policy.version, 0))
        row = second.service.ledger.get(key)
        assert row is not None and row.submission_hash not in sent and row.outcome == "accepted", row
        assert second.service.ledger.node_summary(node.address)["verdicts"] == {"accepted": {"accepted": 1}}


def test_work_kept_through_an_outage_goes_out_as_one_envelope(
        published: Pools, deployment_file: Path, make_validator: Any, tmp_path: Path) -> None:
    # the run's only validator is down when the work is signed, and stays down while the node retries: every retry
    # sends the envelope sealed first (the `sent` table grew by one envelope per retry before: 2,287 rows for one
    # assignment in a crashed node's state dir), and the validator back on its URL decides exactly those bytes
    first = make_validator("first")
    port = int(first.url.rsplit(":", 1)[1])
    node = published.new_node()
    cfg = node_config(tmp_path, deployment_file, published.chain.rpc_url, [first.url], run=RUN, model=TINY,
                      submit={"attempts": 2, "backoff_s": 0.05, "max_backoff_s": 0.1})
    chain = commands.open_chain(cfg)
    with httpx.Client(timeout=10) as http, SlashingProtection(tmp_path / "p.sqlite") as db:
        worker = make_worker(cfg, node, chain, db, http, [first.url])
        worker.validators.refresh()
        policy = worker.weights.select()
        first.stop()
        sub = build_submission(policy.engine, RUN, node.address, policy.version, 0, policy.manifest_hash,
                               chain_id=worker.chain_id, pool=worker.pool)
        assert worker.submit(sub) == {}  # kept: nobody answers
        sent = db.sent_hashes(RUN.run_id, node.address, policy.version, 0)
        assert len(sent) == 1
        for _ in range(4):
            assert worker.resend_unsent() is False
        assert db.sent_hashes(RUN.run_id, node.address, policy.version, 0) == sent
        # one post failed; after it the validator is probed on the side (`_probe_aside`) and gets no body until it
        # answers: the retries are probes, and the envelope waits as it was sealed
        assert worker.tally.submit_failures == 1 and worker._strikes

        second = make_validator("second", port=port)
        deadline = time.monotonic() + 120
        while not worker.resend_unsent():  # the validator's back-off marks end; the same bytes are taken
            assert time.monotonic() < deadline, worker.tally
            time.sleep(0.2)
        worker.wait_decided(120)
        rec = db.get(RUN.run_id, node.address, policy.version, 0)
        assert rec is not None and rec.state == "decided", rec
        key = to_hex(published.work_key(RUN.run_id, node.address, policy.version, 0))
        row = second.service.ledger.get(key)
        assert row is not None and row.submission_hash in sent and row.outcome == "accepted", row
        assert not worker.tally.peer_errors, worker.tally.peer_errors
