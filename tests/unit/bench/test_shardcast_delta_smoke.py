"""`python -m bench.shardcast --delta --smoke`: the delta mode's whole path once (full and delta through origin,
relays and clients holding v1), its JSON keys, and the byte ratio its deterministic weights give (no timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_delta_smoke_writes_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "delta.json"
    subprocess.run([sys.executable, "-m", "bench.shardcast", "--delta", "--smoke", "--json", str(out)], cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, check=True, timeout=280,
                   capture_output=True)
    report = json.loads(out.read_text())
    assert report["full_time_over_delta_time"] > 0 and report["smoke"] is True
    # 2% of bf16 elements changed: 4-byte positions + 2-byte values per change, ~6% of the full bytes
    assert 0.03 < report["delta_bytes_over_full"] < 0.1
