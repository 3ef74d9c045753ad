"""The operator dashboard of a running devnet (tiny model, two nodes), loaded in a real headless Chromium:
the numbers it shows match the ledgers they come from. The network keeps working while the page loads, so
every counter shown must lie between the ledgers read just before and just after the load; what cannot
change (rewards of finished steps, stakes) must match exactly. Saves a screenshot (PRIME_DASHBOARD_SCREENSHOT
=PATH keeps a copy). Slow tier: the devnet takes ~2 minutes to come up and train on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from headless import browser, dump_dom, marked, screenshot

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _ledgers(layout: dict[str, Any]) -> dict[str, Any]:
    """Validators' audit counts (summed, and accepted per node), and the pool's events and node records."""
    from contracts.deployment import Deployment
    from contracts.devchain import dev_identity
    from contracts.pool import PoolClient
    from contracts.transactor import connect

    totals = {"received": 0, "accepted": 0}
    per_node: dict[str, int] = {}
    for v in layout["validators"]:
        audit = httpx.get(v["url"] + "/v1/audit", timeout=10).json()
        for k in totals:
            totals[k] += audit["counts"][k]
        for node, counts in audit["nodes"].items():
            per_node[node] = per_node.get(node, 0) + counts["accepted"]
    dep = Deployment.load(layout["deployment"])
    pool = PoolClient(connect(layout["rpc_url"]), dep.pool, dev_identity(0))  # reads only (DEV ONLY key)
    events: dict[str, int] = {}
    for e in pool.events(dep.start_block):
        events[e.name] = events.get(e.name, 0) + 1
    stakes = {n["address"]: pool.get_node(n["address"]).stake for n in layout["nodes"]}
    return {"totals": totals, "per_node": per_node, "events": events, "stakes": stakes,
            "policy_version": pool.policy()[0]}


def test_dashboard_shows_what_the_ledgers_hold(tmp_path: Path) -> None:
    browser()  # skip before starting a network when there is no Chromium
    state = tmp_path / "devnet"
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "devnet.cli", "up", "--state-dir", str(state), "--nodes", "2", "--dashboard-port", "0",
         "--trainer.max-steps", str(STEPS + 2), "--summary-interval-s", "1", "--start-timeout-s", "150"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        metrics = state / "trainer" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= STEPS):
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()[-3000:]
            time.sleep(1)
        layout = json.loads((state / "devnet.json").read_text())
        url = layout["dashboard"] + "/"

        before = _ledgers(layout)
        dom = dump_dom(url)
        after = _ledgers(layout)
        shown = marked(dom)

        def between(key: str, lo: int, hi: int) -> int:
            value = int(shown.one(key))
            assert lo <= value <= hi, (key, lo, value, hi)
            return value

        assert between("totals.received", before["totals"]["received"], after["totals"]["received"]) > 0
        between("totals.accepted", before["totals"]["accepted"], after["totals"]["accepted"])
        assert shown.one("totals.rejected_hard") == "0"
        between("chain.policy_version", before["policy_version"], after["policy_version"])
        for name in ("WorkRecorded", "PolicyPublished", "NodeRegistered"):
            between(f"events.{name}", before["events"].get(name, 0), after["events"].get(name, 0))
        for node in layout["nodes"]:
            key = f"node.{node['address']}."
            assert between(key + "accepted", before["per_node"].get(node["address"], 0),
                           after["per_node"].get(node["address"], 0)) > 0
            assert int(shown.one(key + "stake")) == before["stakes"][node["address"]] == after["stakes"][node["address"]]
            assert shown.one(key + "status") == "ACTIVE"
        # every reward point plotted is the trainer's own number for that step
        steps = {m["step"]: m["reward_mean"] for m in map(json.loads, metrics.read_text().splitlines())}
        points = [(int(e["data-step"]), float(e["data-value"])) for e in shown.elements
                  if e["<tag>"] == "circle" and "data-step" in e]
        assert len(points) >= STEPS - 1
        assert all(abs(steps[s] - v) < 1e-6 for s, v in points), (points, steps)
        # submissions over time: the bars add up to the submissions listed, between the two ledger reads
        bars = sum(int(e["data-value"]) for e in shown.elements if e["<tag>"] == "rect" and e.get("data-kind"))
        assert before["totals"]["received"] <= bars <= after["totals"]["received"]
        # versions reached the nodes: seconds from signing to the first batch, both percentiles shown
        delays = [float(e["data-value"]) for e in shown.elements if e["<tag>"] == "circle" and "data-version" in e]
        assert delays and all(0 <= d < 300 for d in delays)
        assert float(shown.one("propagation.p50").removesuffix(" s")) <= float(shown.one("propagation.p99"))

        shot = screenshot(url, tmp_path / "dashboard.png", height=1450)
        keep = os.environ.get("PRIME_DASHBOARD_SCREENSHOT")
        if keep:
            shutil.copyfile(shot, keep)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=90)
        finally:
            if up.poll() is None:
                up.kill()
            log.close()
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
