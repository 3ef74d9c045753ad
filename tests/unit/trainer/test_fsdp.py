"""FSDP2 over 2 CPU processes (gloo, torchrun) trains exactly like 1 process on the same data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun import torchrun, trainer_env

from tests.unit.trainer.rollout_factory import directory_run_config, write_step_files


def _run(args: list[str], cwd: Path) -> None:
    r = subprocess.run(args, cwd=cwd, env=trainer_env(), timeout=150, capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-8000:]


@pytest.mark.timeout(200)
def test_two_process_fsdp2_equals_one_process(tmp_path: Path) -> None:
    write_step_files(tmp_path / "roll", 3, groups=4, size=4, vocab=320)
    cfg = tmp_path / "c.toml"
    cfg.write_text(directory_run_config(steps=3, rollouts=tmp_path / "roll", groups_per_step=4))
    # The scheduled held-out eval runs at the end: under torchrun on rank 0's gathered copy of the weights.
    common = ["-m", "trainer.cli", "--config", str(cfg), "--eval.every", "3", "--eval.env", "reverse-text",
              "--eval.num-tasks", "3", "--eval.max-new-tokens", "4", "--eval.temperatures", "[0, 1]"]
    _run([sys.executable, *common, "--metrics-file", "one.jsonl", "--checkpoint.dir", "ck1"], tmp_path)
    torchrun([*common, "--metrics-file", "two.jsonl", "--checkpoint.dir", "ck2"], tmp_path, timeout=150)
    one = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [m["step"] for m in two] == [0, 1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "clip_low_frac", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert not any(k.startswith("eval/") for k in two[0]) and "eval/greedy/mean_reward" in two[2]
    for key in ("eval/greedy/mean_reward", "eval/t1/mean_reward", "eval/t1/mean_completion_tokens"):
        assert two[2][key] == pytest.approx(one[2][key], abs=1e-6), key
    w1 = load_file(tmp_path / "ck1" / "step-3" / "model.safetensors")
    w2 = load_file(tmp_path / "ck2" / "step-3" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    w0 = load_file(tmp_path / "ck1" / "step-2" / "model.safetensors")
    assert any(not torch.equal(w0[k], w1[k]) for k in w1)  # training really moved the weights
