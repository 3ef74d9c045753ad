"""Separate hosts on one machine (slow tier, root only): `prime-devnet up --hosts netns` with 2 validators, 2 relays
and 3 nodes, each role in its own network namespace at its own address, trains a few steps; every role's process
lives in its namespace and is reached at its address; a second devnet is refused the subnet in use; `status` and
`audit` (another terminal) read every host and the audit reconciles; `down` leaves no namespace or link of ours.
~2-3 min on a busy 2-core box."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from devnet.hosts import HostPlan, leftovers, unavailable
from devnet.processes import ProcessTable

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
SUBNET = "10.79.0.0/24"  # not the default, so a developer's own `--hosts netns` devnet is never in the way

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devnet.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})


def _netns_inode(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_a_host_per_role_trains_reconciles_and_leaves_nothing(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(why)
    state, log_path = tmp_path / "devnet", tmp_path / "up.log"
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "devnet.cli", "up", "--hosts", "netns", "--subnet", SUBNET, "--state-dir",
             str(state), "--nodes", "3", "--validators", "2", "--relays", "2", "--dashboard-port", "0",
             "--trainer.max-steps", str(STEPS + 20), "--summary-interval-s", "1", "--start-timeout-s", "200"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    plan: HostPlan | None = None
    try:
        metrics = state / "trainer" / "metrics.jsonl"
        deadline = time.monotonic() + 420
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= STEPS):
            assert up.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        plan = HostPlan.load(state)
        assert plan is not None and plan.subnet == SUBNET
        layout = json.loads((state / "devnet.json").read_text())
        assert layout["hosts"] == "netns"

        # every role in its own namespace, at its own address, reached there from the devnet's root namespace
        _, entries = ProcessTable.read(state)
        roles = {e.name: e for e in entries if e.role != "job"}
        assert set(roles) == {h.name for h in plan.hosts}
        root_ns = _netns_inode(os.getpid())
        inodes = {name: _netns_inode(e.pid) for name, e in roles.items()}
        assert root_ns not in inodes.values() and len(set(inodes.values())) == len(inodes)
        for name, e in roles.items():
            assert e.url == f"http://{plan.host(name).address}:{e.port}", (name, e.url)
        urls = ([layout["rpc_url"], layout["origin"], layout["trainer"]["metrics_url"]] + layout["relays"]
                + [v["url"] for v in layout["validators"]] + [n["url"] for n in layout["nodes"]])
        assert not [u for u in urls if "127.0.0.1" in u or "localhost" in u], urls
        for n in layout["nodes"]:
            assert httpx.get(n["url"] + "/health", timeout=10).status_code == 200
        for v in layout["validators"]:
            assert httpx.get(v["url"] + "/v1/info", timeout=10).status_code == 200
        port = layout["dashboard"].rsplit(":", 1)[1]
        assert httpx.get(f"http://{plan.gateway}:{port}/health", timeout=10).status_code == 200

        # a second devnet on the same subnet is refused before it makes anything
        other = _cli("up", "--hosts", "netns", "--subnet", SUBNET, "--state-dir", str(tmp_path / "other"))
        assert other.returncode == 1 and "already in use" in other.stderr, other.stderr[-2000:]
        assert HostPlan.load(tmp_path / "other") is None

        status = _cli("status", "--state-dir", str(state))
        assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr
        audit = _cli("audit", "--state-dir", str(state))
        assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]

        down = _cli("down", "--state-dir", str(state))
        assert down.returncode == 0, down.stdout + down.stderr
        up.wait(timeout=60)
        assert leftovers(plan) == []
        _, entries = ProcessTable.read(state)
        assert not [e.name for e in entries if e.alive() or e.group_members()]
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=120)
        if plan is not None and shutil.which("ip"):
            left = leftovers(plan)
            if left:  # never leave a namespace behind, even when an assertion failed
                from devnet.hosts import teardown

                teardown(state)
            assert leftovers(plan) == []
