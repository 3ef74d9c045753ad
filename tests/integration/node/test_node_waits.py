"""Whatever prime-node's loop waits for, it says so at once, in one log line and in /health (`waiting_for`,
`detail`), and again every SAY_AGAIN_S while the wait lasts (issue 28 item 4): a node never stalls
silently (/metrics: prime_node_waiting_seconds{reason}). Real anvil, a real validator on 127.0.0.1, the tiny model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from chainfixtures import Pools
from test_node_join import make_worker, node_config, start_loop

from bench.loopback import RUN
from contracts.policy import PolicyHistory
from node import commands
from node import worker as worker_module
from node.monitor import health
from node.protection import SlashingProtection

pytestmark = pytest.mark.timeout(300)


def _until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextmanager
def running(worker: Any) -> Iterator[list[BaseException]]:
    failures: list[BaseException] = []
    thread = start_loop(worker, failures)
    try:
        yield failures
    finally:
        worker.stop()
        thread.join(timeout=60)


def waiting_for(worker: Any) -> str | None:
    return health(worker.tally, 0)[1]["waiting_for"]


def test_each_wait_is_said_in_the_log_and_in_health(published: Pools, deployment_file: Path, make_validator: Any,
                                                    tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "SAY_AGAIN_S", 0.5)  # the repeat, shortened so the test sees it
    caplog.set_level(logging.WARNING, logger="node.worker")
    served = make_validator()
    node = published.new_node()
    run = RUN.model_copy(update={"max_batches_per_version": 1})
    with httpx.Client(timeout=10) as http:
        # a validator nobody answers at: "validator", said again while it lasts
        cfg = node_config(tmp_path / "a", deployment_file, published.chain.rpc_url, ["http://127.0.0.1:9"],
                          max_batches=None, run=run)
        with SlashingProtection(tmp_path / "a.sqlite") as db:
            w = make_worker(cfg, node, commands.open_chain(cfg), db, http, ["http://127.0.0.1:9"], run=run)
            with running(w) as failures:
                _until(lambda: waiting_for(w) == "validator", f"not waiting for a validator: {w.tally} {failures}")
                _until(lambda: sum("waiting (validator" in r.message for r in caplog.records) >= 2,
                       "the wait was not said again")
                assert "127.0.0.1:9" in w.tally.detail and health(w.tally, 0)[1]["waiting_s"] is not None

        # no policy version on chain as far as this node reads: "version"
        cfg = node_config(tmp_path / "b", deployment_file, published.chain.rpc_url, [served.url], max_batches=None,
                          run=run)
        chain = commands.open_chain(cfg)
        with SlashingProtection(tmp_path / "b.sqlite") as db:
            w = make_worker(cfg, node, chain, db, http, [served.url], run=run)
            head = published.admin.w3.eth.block_number
            w.weights.history = PolicyHistory(chain.client(node), head + 1)  # reads from after v1's publication
            with running(w) as failures:
                _until(lambda: waiting_for(w) == "version", f"not waiting for a version: {w.tally} {failures}")
                assert "no policy version" in w.tally.detail
                assert any("waiting (version" in r.message for r in caplog.records)

        # its one assignment at v1 done: "assignments"
        cfg = node_config(tmp_path / "c", deployment_file, published.chain.rpc_url, [served.url], max_batches=None,
                          run=run)
        with SlashingProtection(tmp_path / "c.sqlite") as db:
            w = make_worker(cfg, node, commands.open_chain(cfg), db, http, [served.url], run=run)
            with running(w) as failures:
                _until(lambda: waiting_for(w) == "assignments", f"not waiting for the next version: {w.tally} "
                       f"{failures}")
                assert w.tally.batches == 1 and "v1" in w.tally.detail
                assert any("waiting (assignments" in r.message for r in caplog.records)
            assert not failures, failures
