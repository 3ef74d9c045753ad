"""The short version of `python -m bench.learning --model smollm2`'s network run: SmolLM2-135M fine-tuned for one SFT step
(`prime-trainer sft` with the shipped reverse-text config), that checkpoint published as version 0 of a small devnet
(`prime-devnet up --model smollm2 --init`: 1 node, 1 validator, 1 relay), 2 GRPO steps on the nodes' checked work
with the held-out evaluation (`trainer.eval`, greedy and sampled) on 4 tasks, and the checkpoint scored once before.
Checks that the run started from the checkpoint (the chain's v0 hash is the manifest the relay serves, and the
weights the node and the validator pulled as v0 are the checkpoint's tensors), that the evaluation rows exist with
pass rates for step 0 and after the last step, that the steps trained on accepted work, and that the audit
reconciles. Slow tier: ~5-10 min on a busy 2-core box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_smollm2_from_an_sft_checkpoint_trains_through_the_devnet_with_held_out_evaluation(tmp_path: Path) -> None:
    out = tmp_path / "learning.json"
    cmd = [sys.executable, "-m", "bench.learning", "--model", "smollm2", "--sft-steps", "1",
           "--steps", "2", "--groups", "2", "--group-size", "4", "--max-new-tokens", "16", "--eval-every", "2",
           "--eval-tasks", "4", "--threads", "1", "--nodes", "1", "--validators", "1", "--relays", "1",
           "--no-local", "--work", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "work").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{logs}"
    r = json.loads(out.read_text())

    # version 0 is the SFT checkpoint: on chain, served by the relay, pulled by the node and the validator
    assert r["sft"]["steps"] == 1 and Path(r["sft"]["model"]).is_relative_to(tmp_path)
    assert r["recipe"]["init"] == r["sft"]["model"]
    v0 = r["v0"]
    assert v0["on_chain"] and v0["chain_hash"] == v0["manifest_hash"], v0
    assert v0["weights_are_init"] == {"node-0": True, "validator-0": True}, v0
    assert "--init" in r["network_command"] and r["sft"]["model"] in r["network_command"]

    # both steps trained on the network's accepted work, with the recipe's group size
    assert [m["step"] for m in r["network_metrics"]] == [0, 1]
    assert all(row["network_samples_seen"] > 0 for row in r["rows"])
    assert r["network_time"]["nodes"][0]["batches"] >= 1
    assert r["network_time"]["validation"]["submissions"].get("accepted", 0) >= 1
    assert r["network_time"]["trainer"]["published_versions"] >= 1  # v0 at least (later ones publish in the background)
    # every version after v0 travelled as a delta (issue 37), in the dtype the cpu engine serves: fp32, where every
    # weight Adam moves changes and the tensors go as XOR planes
    published = r["published"]
    assert len(published) >= 2 and [p["version"] for p in published] == list(range(len(published))), published
    assert all(p["dtype"] == "float32" for p in published), published
    assert all(p["kind"] == "delta" and p["bytes"] < p["full_bytes"] for p in published[1:]), published

    # held-out evaluation: the checkpoint before (step 0) and the network run after its last step, greedy and sampled
    rows = {(e["run"], e["after_steps"]): e for e in r["evals"]["rows"]}
    assert set(rows) == {("init", 0), ("network", 2)}, rows
    for e in rows.values():
        for label in ("greedy", "t1"):
            assert 0.0 <= e[f"{label}_pass_rate"] <= 1.0 and 0.0 <= e[f"{label}_mean_reward"] <= 1.0, e
    assert set(r["evals"]["gains"]) == {"network"}

    # every accepted rollout is trained, dropped with a reason or queued; chain and ledgers agree
    assert r["audit"]["ok"], r["audit"]
