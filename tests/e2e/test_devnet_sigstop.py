"""Peers that hang, not only peers that die (issue 26 item 3): on one devnet with two validators, two relays and two
nodes, the process group of one role after another is stopped (`SIGSTOP`: it accepts connections and never
answers) and continued:

- validator-0: the nodes give up on it at their deadline and fail over to validator-1, whose peer watch sees
  validator-0 down, the trainer's feed reader keeps reading validator-1, and the trainer keeps stepping on work
  validator-1 accepted;
- relay-0: nodes and validators pull the new versions from relay-1, and training goes on;
- node-0: node-1 alone supplies the steps (the trainer's bounded fill), and node-0 resumes on `SIGCONT`;
- the chain endpoint (anvil): the network waits for it, and on `SIGCONT` training resumes.

While each role is stopped, the devnet's observer (what `up`'s summary line, `status` and the dashboard show)
and `prime-devnet status` answer, showing that role as down rather than waiting on it. At the end no honest node
holds a hard verdict and `prime-devnet audit` reconciles: nothing lost, nothing recorded or paid twice across the
chain's stop. Slow tier: several minutes on a busy 2-core box."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchload import load_bench

from devnet.dashboard.collector import Collector
from devnet.observer import Observer
from devnet.view import View

ROOT = Path(__file__).resolve().parents[2]


def _accepted(url: str) -> int:
    return int(httpx.get(url + "/v1/audit?rows=false", timeout=10).json()["counts"]["accepted"])


def _is_stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("T")


def _look(run: Any) -> dict[str, Any]:
    """What an operator sees now: the observer's snapshot (as `up`'s summary line reads it), the dashboard's
    collection built on it, and `prime-devnet status` from another process; each must answer."""
    observer = Observer(run.layout)
    try:
        snap: dict[str, Any] = observer.snapshot()
    finally:
        observer.close()
    collector = Collector(run.layout, View(run.layout, lambda: snap, dict))
    try:
        board = collector.collect()
    finally:
        collector.close()
    assert [n["up"] for n in board["nodes"]] == [n["up"] for n in snap["nodes"]]
    assert board["chain"]["up"] == snap["chain"]["up"]
    status = subprocess.run([sys.executable, "-m", "devnet.cli", "status", "--state-dir", str(run.state), "--json"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
    assert json.loads(status.stdout)["snapshot"] is not None, status.stdout[-2000:]
    return snap


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_training_goes_on_while_a_validator_a_relay_a_node_or_the_chain_is_stopped(tmp_path: Path) -> None:
    churn = load_bench("churn")

    run = churn.Run(tmp_path / "devnet", False, 10.0, ["--validators", "2", "--nodes", "2", "--relays", "2"])
    stopped: int | None = None

    def stop(name: str) -> int:
        nonlocal stopped
        stopped = run.net.table.entries[name].pid
        os.killpg(stopped, signal.SIGSTOP)
        return stopped

    def cont() -> None:
        nonlocal stopped
        assert stopped is not None and _is_stopped(stopped)  # it stayed stopped for the whole phase
        os.killpg(stopped, signal.SIGCONT)
        stopped = None

    try:
        run.up()
        run.wait("2 trained steps", lambda: run.step() >= 2, 900)

        # a validator
        backup = run.layout.validators[1]["url"]
        stop("validator-0")
        step, accepted = run.step(), _accepted(backup)
        run.wait("3 more steps with validator-0 stopped", lambda: run.step() >= step + 3, 600)
        run.wait("work accepted by validator-1", lambda: _accepted(backup) > accepted, 300)
        assert [v["up"] for v in _look(run)["validators"]] == [False, True]
        cont()
        run.wait("a step after validator-0 came back", lambda: run.step() >= step + 4, 600)

        # a relay: the other one serves the new versions
        stop("relay-0")
        step = run.step()
        run.wait("2 more steps with relay-0 stopped", lambda: run.step() >= step + 2, 600)
        assert all(n["up"] for n in _look(run)["nodes"])
        cont()

        # a node: the other one supplies the steps; the stopped one resumes after
        stop("node-0")
        step = run.step()
        run.wait("2 more steps with node-0 stopped", lambda: run.step() >= step + 2, 600)
        assert [n["up"] for n in _look(run)["nodes"]] == [False, True]
        cont()
        batches = int(httpx.get(run.layout.nodes[0]["url"] + "/health", timeout=10).json()["batches"])
        run.wait("a batch from node-0 after it came back", lambda: int(
            httpx.get(run.layout.nodes[0]["url"] + "/health", timeout=10).json()["batches"]) > batches, 600)

        # the chain endpoint: shown as not answering while stopped; training resumes on SIGCONT
        stop("chain")
        step = run.step()
        time.sleep(15)
        chain = _look(run)["chain"]
        assert chain["up"] is False and "no answer from the chain" in chain["error"], chain
        cont()
        run.wait("2 steps after the chain came back", lambda: run.step() >= step + 2, 600)

        time.sleep(3)
        snap = _look(run)
        assert snap["chain"]["up"] is True, snap["chain"]
        assert snap["verdicts"].get("rejected_hard", 0) == 0, snap["verdicts"]  # late is not wrong
        report = run.audit(180)
        assert report["ok"], report["mismatches"]
    finally:
        if stopped is not None:
            os.killpg(stopped, signal.SIGCONT)
        run.stop()
