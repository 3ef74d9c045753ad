"""`python -m bench.node --smoke --engines vllm` runs the node's loop on the vLLM engine and writes its JSON (`make test-vllm`;
the `models/` engine's smoke is tests/unit/bench/test_bench_smoke.py). Slow: a chain, a validator and a vLLM engine
start (~1-2 minutes on 2 cores). Behaviour only: no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make setup-vllm` then `make test-vllm`")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_node_bench_smoke_runs_the_loop_on_vllm(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CONFIGURE_LOGGING": "0"}
    proc = subprocess.run([sys.executable, "-m", "bench.node", "--smoke", "--engines", "vllm", "--json",
                           str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["info"]["engines"] == ["vllm"]
    [row] = result["results"]
    assert (row["model"], row["engine"]) == ("tiny", "vllm")
    assert row["same_tokens"] and row["loop_tokens"] > 0 and row["breakdown_s"]["proofs"] is None
    assert "vllm" in proc.stdout
