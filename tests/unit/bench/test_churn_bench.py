"""`python -m bench.churn --smoke`: the report's arithmetic (steps per minute, reward per sample weighted by samples,
churn / steady ratios) runs in seconds, so the benchmark cannot rot; the devnet run itself is the slow-tier
tests/e2e/test_churn.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_smoke_reports_rates_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    done = subprocess.run([sys.executable, "-m", "bench.churn", "--smoke", "--json", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    assert res["steady"]["window"]["steps_per_min"] == 12.0 and res["churn"]["window"]["steps_per_min"] == 8.0
    assert res["churn"]["window"]["samples_per_step"] == 38.0  # 3 steps of 48 and 5 of 32 samples
    assert res["ratio"] == {"steps_per_min": 0.667, "reward_per_sample": 1.0, "samples_per_step": 0.792}
    assert "churn / steady" in done.stdout
