"""Checkpoints: HF-layout roundtrip, sharding, truncated or corrupt files rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import LoadedModel
from models.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from protocol.errors import ModelError

IDS = torch.tensor([[1, 10, 20, 30, 40, 50]])


def _logits(m: LoadedModel) -> torch.Tensor:
    with torch.inference_mode():
        return m.model(IDS).logits


def test_roundtrip_identical_logits_and_hf_layout(tiny: LoadedModel, tmp_path: Path) -> None:
    path = save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "ck")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    back = load_checkpoint(path)
    assert torch.equal(_logits(tiny), _logits(back))
    # saving again over an existing checkpoint replaces it atomically
    save_checkpoint(back.model, back.tokenizer, path)
    assert torch.equal(_logits(tiny), _logits(load_checkpoint(path)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_sharded_roundtrip(tiny: LoadedModel, tmp_path: Path) -> None:
    path = save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "ck", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    assert torch.equal(_logits(tiny), _logits(load_checkpoint(path)))


def test_bf16_roundtrip(tiny_bf16: LoadedModel, tmp_path: Path) -> None:
    path = save_checkpoint(tiny_bf16.model, tiny_bf16.tokenizer, tmp_path / "ck")
    back = load_checkpoint(path, dtype="bfloat16")
    assert torch.equal(_logits(tiny_bf16), _logits(back))


def test_truncated_checkpoint_is_model_error(tiny: LoadedModel, tmp_path: Path) -> None:
    path = save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "ck")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match="truncated"):
        verify_checkpoint(path)
    with pytest.raises(ModelError):
        load_checkpoint(path)
    weights.write_bytes(data[:5])
    with pytest.raises(ModelError):
        load_checkpoint(path)


def test_corrupt_header_and_missing_shard(tiny: LoadedModel, tmp_path: Path) -> None:
    path = save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "ck")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # garbage inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError):
        load_checkpoint(path)
    sharded = save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "sh", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    (sharded / victim).unlink()
    with pytest.raises(ModelError, match="missing shard"):
        load_checkpoint(sharded)
    (sharded / "config.json").unlink()
    with pytest.raises(ModelError):
        verify_checkpoint(sharded)
