"""The trainer's work ledger: which validator work keys each step trained, dropped or still holds queued
(what `prime-devnet audit` reconciles with the validators' ledgers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.canonical import to_hex
from protocol.work_ledger import WorkLedger, read_work_ledger
from tests.unit.trainer.feed_server import DOMAIN, RUN_ID, FeedServer, feed_item
from trainer.validator_feed import ValidatorFeedSource

pytestmark = pytest.mark.timeout(60)


def test_a_step_records_the_work_it_trained_dropped_and_left_queued(tmp_path: Path) -> None:
    with FeedServer() as v:
        items = {version: feed_item(version, version, groups=2) for version in (0, 7, 3, 4, 5)}
        extra = feed_item(5, 6, groups=2)
        for item in [*items.values(), extra]:
            v.add(item)
        src = ValidatorFeedSource([v.url], DOMAIN, addresses=[v.address], run_id=RUN_ID, poll_interval_s=0.02,
                                  wait_timeout_s=60.0, vocab_size=64)  # filled at once; the wait is for a busy box
        try:
            batch = src.next_batch(step=5, n_groups=4, async_level=1)
            key = {version: to_hex(item.work_key) for version, item in items.items()}
            assert batch.work == {"stale": [key[0], key[3]], "future": [key[7]], "trained": [key[4], key[5]]}
            ledger = WorkLedger(tmp_path / "work.jsonl")
            ledger.record(5, batch.work, src)
            ledger.record(5, batch.work, src)  # a step re-run after a crash: written twice, read once
            lines = read_work_ledger(tmp_path / "work.jsonl")
            assert list(lines) == [5]
            line = lines[5]
            assert line["trained"] == [key[4], key[5]] and line["stale"] == [key[0], key[3]]
            assert line["queued"] == [to_hex(extra.work_key)]  # fetched, not consumed
            assert line["cursors"] == {v.url: 5}  # the five consumed items; the sixth is past the cursor
            assert json.loads((tmp_path / "work.jsonl").read_text().splitlines()[0])["step"] == 5
        finally:
            src.close()
