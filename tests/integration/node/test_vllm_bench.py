"""The benches that run vLLM (`make test-vllm`; the `models/` engine's smokes are tests/unit/bench/test_bench_smoke.py).
`python -m bench.node --smoke --engines vllm` runs the node's loop on the vLLM engine (slow: a chain, a validator and a
vLLM engine start, ~1-2 minutes on 2 cores); `python -m bench.generate --smoke --engines models,vllm` runs plain vLLM
beside the node's vLLM engine. Behaviour only: no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make setup-vllm` then `make test-vllm`")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.vllm]


@pytest.mark.slow
@pytest.mark.timeout(900)
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


@pytest.mark.timeout(600)
def test_the_generate_bench_smoke_measures_the_protocol_against_plain_vllm(tmp_path: Path) -> None:
    """`python -m bench.generate --engines models,vllm` runs plain vLLM beside the node's vLLM engine on the same
    prompts and settings and reports the protocol's cost inside vLLM (issue 38 item 5)."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_CONFIGURE_LOGGING": "0"}
    proc = subprocess.run([sys.executable, "-m", "bench.generate", "--smoke", "--engines", "models,vllm", "--dtypes",
                           "bfloat16", "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(out.read_text())
    [row] = result["results"]
    assert row["vllm_tokens"] > 0 and row["vllm_plain_tok_s"] > 0
    assert result["ratio_vllm_protocol_over_plain"] == {"bfloat16/tiny/2": row["ratio_vllm_protocol_over_plain"]}
    assert row["vllm_protocol_seconds_per_token"]["sample"] > 0 and 0 < row["vllm_protocol_share"] < 1
    assert result["vllm_protocol_share"] == {"bfloat16/tiny/2": row["vllm_protocol_share"]}
    assert result["info"]["sampler_search"].startswith("compiled (numba ")  # numba: a dependency, and vLLM's
    assert result["info"]["vllm_worker_sampler_search"].startswith("compiled (numba ")
    assert "of the vLLM worker's time" in proc.stdout
    assert "plain vllm" in proc.stdout
