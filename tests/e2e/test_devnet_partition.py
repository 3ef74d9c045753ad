"""Partitions on separate hosts (slow tier, root only; issue 26 item 4): with `prime-devnet up --hosts netns`, a node
and a relay are cut off the network (`prime-devnet cut`: the link down inside their namespaces) for longer than
a trainer step, then a validator and the trainer for a few seconds, and everything is healed. Training goes on
while the node is away (the others supply a step), the node resumes after, no honest node is slashed or gets a
hard verdict for being late, and the audit reconciles. ~4 min on a busy 2-core box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from devnet.hosts import HostPlan, leftovers, teardown, unavailable

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.80.0.0/24"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devnet.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})


def _steps(metrics: Path) -> int:
    try:
        return len({json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()})
    except (OSError, ValueError, KeyError):
        return 0


def _until(what: str, check: Callable[[], bool], up: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert up.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s\n" + log.read_text()[-3000:]
        time.sleep(1)


def _health(url: str) -> dict[str, object]:
    try:
        body = httpx.get(url + "/health", timeout=5).json()
        return body if isinstance(body, dict) else {}
    except (httpx.HTTPError, ValueError):
        return {}


def test_partitioned_roles_are_late_not_wrong(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    state, log_path = tmp_path / "devnet", tmp_path / "up.log"
    # 2 submissions per step from 3 nodes: a step does not need every node
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "devnet.cli", "up", "--hosts", "netns", "--subnet", SUBNET, "--state-dir",
             str(state), "--nodes", "3", "--validators", "2", "--relays", "2", "--dashboard-port", "0",
             "--trainer.groups-per-step", "4", "--trainer.max-steps", "200", "--summary-interval-s", "1",
             "--start-timeout-s", "200"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    metrics = state / "trainer" / "metrics.jsonl"
    try:
        _until("2 trainer steps", lambda: _steps(metrics) >= 2, up, log_path, 420)
        plan = HostPlan.load(state)
        assert plan is not None
        layout = json.loads((state / "devnet.json").read_text())
        node0 = next(n["url"] for n in layout["nodes"] if n["name"] == "node-0")

        # a node and a relay away for more than a step: the trainer goes on with the others' work
        cut = _cli("cut", "--state-dir", str(state), "node-0", "relay-0")
        assert cut.returncode == 0, cut.stderr
        assert _health(node0) == {}  # unreachable from the devnet's own address
        at_cut = _steps(metrics)
        _until("2 steps while node-0 is cut off", lambda: _steps(metrics) >= at_cut + 2, up, log_path, 300)
        assert _cli("heal", "--state-dir", str(state), "node-0", "relay-0").returncode == 0
        accepted_before = int(str(_health(node0).get("accepted") or 0)) if _health(node0) else 0
        _until("node-0 accepted again after the partition",
               lambda: int(str(_health(node0).get("accepted") or 0)) > accepted_before, up, log_path, 300)

        # a validator and the trainer away for a few seconds each
        for name in ("validator-1", "trainer"):
            assert _cli("cut", "--state-dir", str(state), name).returncode == 0
            time.sleep(8)
            assert _cli("heal", "--state-dir", str(state), name).returncode == 0
        healed = _steps(metrics)
        _until("2 more steps after every partition", lambda: _steps(metrics) >= healed + 2, up, log_path, 300)

        snap = _cli("status", "--state-dir", str(state), "--json")
        data = json.loads(snap.stdout)["snapshot"]
        assert data["verdicts"].get("rejected_hard", 0) == 0, data["verdicts"]
        assert data["chain"]["events"].get("StakeSlashed", 0) == 0, data["chain"]["events"]
        # the reporter of the validator that was cut off caught up: nothing accepted is left unrecorded
        deadline = time.monotonic() + 120
        while True:
            audit = _cli("audit", "--state-dir", str(state))
            if audit.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert audit.returncode == 0, audit.stdout[-4000:]
        assert _cli("down", "--state-dir", str(state)).returncode == 0
        up.wait(timeout=60)
        assert leftovers(plan) == []
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=120)
        teardown(state)
