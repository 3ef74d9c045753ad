"""`python -m bench.shardcast --delta --smoke`: the delta mode's whole path once (full and delta through origin,
relays and clients holding v1), its JSON keys, and the byte ratio its deterministic weights give (no timing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _delta_smoke(tmp_path: Path, *args: str) -> dict[str, Any]:
    """`python -m bench.shardcast --delta --smoke *args`'s JSON report (its output shown when it fails)."""
    out = tmp_path / "delta.json"
    done = subprocess.run([sys.executable, "-m", "bench.shardcast", "--delta", "--smoke", *args, "--json", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          timeout=280, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.mark.timeout(300)
def test_delta_smoke_writes_both_ratios(tmp_path: Path) -> None:
    report = _delta_smoke(tmp_path)
    assert report["full_time_over_delta_time"] > 0 and report["smoke"] is True
    # 2% of bf16 elements changed: a 1-2 byte gap + the 2-byte value per change, ~3% of the full bytes (measured
    # 0.031; absolute 4-byte positions gave 0.060)
    assert 0.02 < report["delta_bytes_over_full"] < 0.045


@pytest.mark.timeout(300)
def test_trained_delta_smoke_publishes_real_checkpoints_through_the_trainers_publisher(tmp_path: Path) -> None:
    """`--delta --train-lrs` on the tiny model: three trainer steps, each version through the trainer's publisher,
    the changed fraction of each step and the last pair through the relay tree (counts, not timing)."""
    report = _delta_smoke(tmp_path, "--train-lrs", "1e-5")
    (entry,) = report["per_lr"]
    assert entry["lr"] == 1e-5 and [r["version"] for r in entry["versions"]] == [1, 2, 3]
    first, *later = entry["versions"]
    assert first["bytes"] == first["full_bytes"] and "changed_fraction" not in first  # the first is an anchor
    # a real Adam step changes some bf16 weights and leaves others (fp32 master weights, bf16 rounding); a step
    # whose groups all tied (no advantage, no gradient) may change none
    assert all(0.0 <= row["changed_fraction"] < 1.0 and row["bytes"] <= row["full_bytes"] for row in later), later
    assert any(row["changed_fraction"] > 0.0 for row in later), later
    assert report["full_time_over_delta_time"] > 0 and 0 < report["delta_bytes_over_full"] <= 1.0


def _namespaces() -> str | None:
    """Why a shaped link cannot be made here (None: it can): it needs root, unshare, ip and tc with tbf."""
    probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root tbf rate "
                            "100mbit burst 65536 latency 200ms"], capture_output=True, text=True, timeout=30) \
        if all(shutil.which(t) for t in ("unshare", "ip", "tc")) else None
    if probe is None:
        return "unshare, ip or tc is not installed"
    return None if probe.returncode == 0 else f"no shaped namespace here: {probe.stderr.strip()[:200]}"


@pytest.mark.timeout(300)
def test_delta_smoke_on_a_shaped_link_runs_in_its_own_namespace(tmp_path: Path) -> None:
    """`--link-mbit`: the same run inside a network namespace whose loopback is shaped (the host's is not)."""
    why = _namespaces()
    if why is not None:
        pytest.skip(why)
    report = _delta_smoke(tmp_path, "--link-mbit", "400")
    assert report["link_mbit"] == 400.0 and report["full_time_over_delta_time"] > 0
    assert 0.02 < report["delta_bytes_over_full"] < 0.045
    # the host's loopback was never shaped
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
