"""A chain that behaves like a public one (slow tier, issue 26 item 5): `prime-devnet up --chain.block-time 2`,
then the trainer's `publishPolicy` is dropped from the pool (`anvil_dropAllTransactions`, everyone else's
pending transactions with it) and a few blocks are rolled back (`evm_snapshot`/`evm_revert`, standing in for a
reorg). Training goes on past both, and `prime-devnet audit` reconciles: nothing lost, nothing recorded twice."""

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

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _rpc(url: str, method: str, params: list[Any] | None = None) -> Any:
    body = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []},
                      timeout=10).json()
    assert "error" not in body, body
    return body["result"]


def _steps(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait(what: str, predicate: Any, up: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert up.poll() is None, f"the devnet stopped while waiting for {what}:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + log.read_text()[-3000:]
        time.sleep(0.1)


def test_slow_chain_with_a_dropped_publish_and_a_rollback_keeps_training_and_reconciles(tmp_path: Path) -> None:
    state, log_path = tmp_path / "devnet", tmp_path / "up.log"
    metrics = state / "trainer" / "metrics.jsonl"
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "devnet.cli", "up", "--state-dir", str(state), "--nodes", "2", "--dashboard-port",
             "0", "--trainer.max-steps", "40", "--summary-interval-s", "5", "--start-timeout-s", "200",
             "--chain.block-time", "2"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        _wait("two trainer steps", lambda: _steps(metrics) >= 2, up, log_path)
        layout = json.loads((state / "devnet.json").read_text())
        rpc = layout["rpc_url"]
        trainer = json.loads(Path(layout["deployment"]).read_text())["trainers"][0].lower()

        def trainer_pending() -> bool:
            pending = _rpc(rpc, "txpool_content").get("pending") or {}
            return any(addr.lower() == trainer for addr in pending)

        # the trainer's next publishPolicy waits for its block: drop it (and whatever else is pending)
        _wait("a pending publishPolicy", trainer_pending, up, log_path)
        _rpc(rpc, "anvil_dropAllTransactions")
        dropped_at = _steps(metrics)
        # a reorg stand-in: a few blocks mined, then taken back
        snapshot = _rpc(rpc, "evm_snapshot")
        start = int(_rpc(rpc, "eth_blockNumber"), 16)
        _wait("three blocks", lambda: int(_rpc(rpc, "eth_blockNumber"), 16) >= start + 3, up, log_path, timeout=60)
        assert _rpc(rpc, "evm_revert", [snapshot]) is True

        _wait("training past the faults", lambda: _steps(metrics) >= dropped_at + 3, up, log_path, timeout=400)
        logs = "\n".join(p.read_text(errors="replace") for p in state.rglob("*.log"))
        assert "dropped from the pool" in logs  # noticed and resent, not waited out
        deadline = time.monotonic() + 120
        while True:  # the reporters catch up within a few rounds
            audit = subprocess.run([sys.executable, "-m", "devnet.cli", "audit", "--state-dir", str(state)], cwd=REPO,
                                   capture_output=True, text=True, timeout=60)
            if "audit: reconciled" in audit.stdout or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert "audit: reconciled" in audit.stdout, audit.stdout + audit.stderr
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=90)
        finally:
            if up.poll() is None:
                up.kill()
