"""A SIGSTOPped validator does not stop training (issue 26 item 3): on a devnet with two validators,
validator-0's process group is stopped (it accepts connections and never answers); the nodes give up on it at
their deadline and fail over to validator-1, whose peer watch sees validator-0 down, the trainer's feed reader
keeps reading validator-1, and the trainer keeps stepping on work validator-1 accepted. Slow tier: minutes."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _accepted(url: str) -> int:
    return int(httpx.get(url + "/v1/audit?rows=false", timeout=10).json()["counts"]["accepted"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_training_goes_on_while_a_validator_is_stopped(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_churn", ROOT / "bench" / "churn.py")
    assert spec is not None and spec.loader is not None
    churn = importlib.util.module_from_spec(spec)
    sys.modules["bench_churn"] = churn
    spec.loader.exec_module(churn)

    run = churn.Run(tmp_path / "devnet", False, 10.0, ["--validators", "2", "--nodes", "2"])
    stopped: int | None = None
    try:
        run.up()
        run.wait("2 trained steps", lambda: run.step() >= 2, 900)
        backup = run.layout.validators[1]["url"]
        stopped = run.net.table.entries["validator-0"].pid
        os.killpg(stopped, signal.SIGSTOP)
        step, accepted = run.step(), _accepted(backup)
        run.wait("3 more steps with validator-0 stopped", lambda: run.step() >= step + 3, 600)
        run.wait("work accepted by validator-1", lambda: _accepted(backup) > accepted, 300)
        # the stopped validator is still stopped: training went on without it
        assert Path(f"/proc/{stopped}/stat").read_text().split(") ")[1].startswith("T")
        os.killpg(stopped, signal.SIGCONT)
        stopped = None
        run.wait("a step after validator-0 came back", lambda: run.step() >= step + 4, 600)
        time.sleep(3)
        assert run.audit(180)["ok"]
    finally:
        if stopped is not None:
            os.killpg(stopped, signal.SIGCONT)
        run.stop()
