"""`python -m bench.attacks` with three attacks and one trial each, so the attack harness cannot rot: a cheat the
model stage catches (one token edited and re-proved), one the envelope catches (a forged signature) and
a hostile relay (bytes flipped in a shard), against real validators on anvil and real relays, plus one
honest submission that must be accepted. A subprocess, so the bench's logging and torch settings stay
out of this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# slow tier (`make test-slow`): keeps the bench program from rotting; the behaviour it checks is covered in the
# default tier by the validator, shardcast and discovery integration tests, and CI's 15 minutes are nearly spent
pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_attack_bench_detects_three_attacks_and_accepts_honest_work(tmp_path: Path) -> None:
    out = tmp_path / "attacks.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attacks", "--only", "edit_token,forged_signature,relay_flip",
         "--trials", "1", "--honest", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {r["attack"]: r for r in res["attacks"]}
    assert set(rows) == {"edit_token", "forged_signature", "relay_flip"}
    assert all(r["trials"] == 1 and r["detected"] == 1 for r in rows.values()), rows
    assert rows["edit_token"]["classes"] == {"hard": 1}
    assert rows["edit_token"]["reasons"] == {"sampling_mismatch": 1}
    assert rows["forged_signature"]["classes"] == {"refused": 1}
    assert rows["forged_signature"]["reasons"] == {"bad_signature": 1}
    assert rows["relay_flip"]["classes"] == {"refused": 1}
    assert res["honest_rollouts"] == 4 and res["false_positives"] == 0
    assert res["on_chain"] == {"slashed": 1, "hard": 1}  # the edited token was slashed on chain with evidence
    assert "attack" in proc.stdout and "false positives: 0" in proc.stdout
