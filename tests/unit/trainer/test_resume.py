"""Exact resume: a run killed with SIGKILL and resumed logs the same losses as an uninterrupted one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from protocol.errors import PrimeError, TrainerError
from protocol.rollout_files import write_rollouts
from tests.unit.trainer.rollout_factory import directory_run_config, make_group, write_step_files
from trainer.config import TrainerConfig
from trainer.grpo import Trainer
from trainer.source import DirectorySource

STEPS = 6



def _write_config(tmp: Path, name: str, rollouts: Path, wait_timeout_s: float = 5.0) -> Path:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(directory_run_config(steps=STEPS, rollouts=rollouts, wait_timeout_s=wait_timeout_s,
                                        extra=f'[checkpoint]\ndir = "{tmp / f"ckpt-{name}"}"\nkeep = 2\n'))
    return cfg


def _losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        m = json.loads(line)
        if m["step"] in out:  # a step re-run after the kill must repeat its loss exactly
            assert out[m["step"]] == m["loss"]
        out[m["step"]] = m["loss"]
    return out


def _cmd(cfg: Path, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "--config", str(cfg), "--metrics-file", str(metrics)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}


@pytest.mark.timeout(180)
def test_kill_9_then_resume_gives_identical_losses(tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts"
    write_step_files(rollouts, STEPS, groups=2, size=4, vocab=320)

    a_metrics = tmp_path / "a.jsonl"
    subprocess.run(_cmd(_write_config(tmp_path, "a", rollouts), a_metrics), env=_env(), check=True, timeout=120)

    # Run b has the files of all steps but the last until it is killed, so it can never finish before the
    # kill, however late this thread wakes (it waits for the last step's file up to 600 s); the kill still lands
    # wherever b is from step 3 on: mid-step, mid-checkpoint or waiting.
    b_rollouts = tmp_path / "rollouts-b"
    write_step_files(b_rollouts, STEPS - 1, groups=2, size=4, vocab=320)
    b_cfg = _write_config(tmp_path, "b", b_rollouts, wait_timeout_s=600.0)
    b_metrics = tmp_path / "b.jsonl"
    proc = subprocess.Popen(_cmd(b_cfg, b_metrics), env=_env())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if b_metrics.exists() and len(b_metrics.read_text().splitlines()) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail("trainer exited before it could be killed")
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    write_step_files(b_rollouts, STEPS, groups=2, size=4, vocab=320)  # the same files, and the last one
    killed_at = len(_losses(b_metrics))
    lines_before = len(b_metrics.read_text().splitlines())
    assert 3 <= killed_at < STEPS
    subprocess.run(_cmd(b_cfg, b_metrics), env=_env(), check=True, timeout=120)
    # It resumed (did not start over): at most the step in flight at the kill is run twice.
    rerun = len(b_metrics.read_text().splitlines()) - lines_before
    assert rerun <= STEPS - killed_at + 1

    a, b = _losses(a_metrics), _losses(b_metrics)
    assert sorted(a) == list(range(STEPS))
    assert a == b
    assert len(set(a.values())) == STEPS  # the losses really change from step to step


def _llama(layers: int = 2, vocab: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )).eval()


@pytest.mark.timeout(120)
def test_resume_into_another_model_or_a_corrupt_state_is_a_trainer_error(tmp_path: Path) -> None:
    # An operator points a run at another model's checkpoints (or the state file is damaged):
    # a classified TrainerError naming the checkpoint, not a bare RuntimeError/KeyError.
    (tmp_path / "r").mkdir()
    write_rollouts(tmp_path / "r" / "0.parquet", make_group(random.Random(0), "g", 0, 4, 64))
    cfg = TrainerConfig.model_validate({
        "max_steps": 1, "progress": False,
        "batch": {"groups_per_step": 1, "seq_len": 32, "async_level": 0},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    })

    def trainer(model: torch.nn.Module) -> Trainer:
        return Trainer(cfg, model, DirectorySource(tmp_path / "r", wait_timeout_s=1), torch.device("cpu"))

    trainer(_llama()).train_step()
    assert trainer(_llama()).resume()  # the same shape resumes
    for other in (_llama(layers=1), _llama(layers=3), _llama(vocab=96)):
        with pytest.raises(TrainerError, match="step-1.*does not match the model"):
            trainer(other).resume()
    state = tmp_path / "ck" / "step-1" / "trainer_state.json"
    state.write_text(json.dumps({"step": 1}))  # no source position
    with pytest.raises(TrainerError, match="trainer_state"):
        trainer(_llama()).resume()
    assert issubclass(TrainerError, PrimeError)
