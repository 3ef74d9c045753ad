"""Local mode end to end on the tiny model: the learnable `lowercase` environment's mean reward rises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import environments
from models import load
from protocol.model_spec import TinyModelSpec
from trainer.config import TrainerConfig
from trainer.grpo import Trainer
from trainer.local import LocalSource


@pytest.mark.timeout(120)
def test_tiny_model_mean_reward_rises(tmp_path: Path) -> None:
    cfg = TrainerConfig.model_validate({
        "max_steps": 20,
        "progress": False,
        "optim": {"lr": 0.02},
        "batch": {"groups_per_step": 4, "seq_len": 128, "micro_batch_rows": 8, "async_level": 0},
        "data": {"type": "local", "env": "lowercase", "group_size": 8, "max_new_tokens": 12},
        "checkpoint": {"dir": str(tmp_path / "ck"), "interval": 100},
    })
    loaded = load(TinyModelSpec(seed=1, hidden_size=32, intermediate_size=64))
    source = LocalSource(loaded, environments.get("lowercase"), group_size=8, max_new_tokens=12)
    trainer = Trainer(cfg, loaded.model, source, torch.device("cpu"), pad_token_id=0, tokenizer=loaded.tokenizer)
    source.attach(trainer.model)
    history = trainer.run()
    rewards = [m["reward_mean"] for m in history]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert all(m["stale_samples"] == 0 and m["staleness_mean"] == 0 for m in history)
    assert last > first + 0.15, rewards
    # On-policy samples: the trainer's recomputed logprobs match the engine's (ratio ~ 1 before the update).
    assert abs(history[0]["ratio_mean"] - 1.0) < 1e-3
