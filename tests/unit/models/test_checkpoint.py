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


def test_a_run_starts_only_from_a_checkpoint_of_its_base_models_architecture_and_vocabulary(tmp_path: Path) -> None:
    """`check_compatible` (what `prime-devnet up --init` asks): another seed of the same tiny model passes; other
    shapes, another vocabulary (size or tokens), no tokenizer, or no checkpoint at all are refused, naming why."""
    from models.checkpoint import check_compatible
    from models.loading import load
    from protocol.model_spec import TinyModelSpec

    base = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256)

    def saved(name: str, spec: TinyModelSpec) -> Path:
        m = load(spec)
        return save_checkpoint(m.model, m.tokenizer, tmp_path / name)

    ok = saved("seed1", base.model_copy(update={"seed": 1}))
    check_compatible(ok, base)
    with pytest.raises(ModelError, match="architecture: hidden_size 64 .*128"):
        check_compatible(saved("narrow", TinyModelSpec(seed=1)), base)
    with pytest.raises(ModelError, match="architecture: vocab_size 600"):
        check_compatible(saved("vocab", base.model_copy(update={"vocab_size": 600})), base)
    tokenizer = json.loads((ok / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, other tokens
    (ok / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelError, match="tokenizer's vocabulary"):
        check_compatible(ok, base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ok / name).unlink()
    with pytest.raises(ModelError, match="tokenizer"):
        check_compatible(ok, base)
    with pytest.raises(ModelError, match="does not exist"):
        check_compatible(tmp_path / "nowhere", base)
    with pytest.raises(ModelError, match="no config.json"):
        check_compatible(tmp_path, base)
