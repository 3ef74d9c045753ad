"""Loading: tiny model determinism (across processes), tokenizer, HF local path, errors."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import LoadedModel, load
from models.checkpoint import save_checkpoint
from models.tiny_tokenizer import build_tiny_tokenizer
from protocol.errors import ModelError
from protocol.model_spec import HFModelSpec, TinyModelSpec

_FINGERPRINT = """
import hashlib, torch
torch.set_num_threads(1)
from models import load
from protocol.model_spec import TinyModelSpec
m = load(TinyModelSpec(seed=0))
h = hashlib.sha256()
for name, p in sorted(m.model.state_dict().items()):
    h.update(name.encode()); h.update(p.contiguous().numpy().tobytes())
h.update(repr(m.tokenizer.encode("Hello, wörld! <eos>", add_special_tokens=False)).encode())
h.update(m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
         add_generation_prompt=True).encode())
print(h.hexdigest())
"""


def _fingerprint_here() -> str:
    return subprocess.run(
        [sys.executable, "-c", _FINGERPRINT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
            "PATH": "/usr/bin:/bin",
        },
    ).stdout.strip()


def test_tiny_model_identical_across_processes(tiny: LoadedModel) -> None:
    a, b = _fingerprint_here(), _fingerprint_here()
    assert a == b and len(a) == 64
    h = hashlib.sha256()
    for name, p in sorted(tiny.model.state_dict().items()):
        h.update(name.encode())
        h.update(p.contiguous().numpy().tobytes())
    h.update(repr(tiny.tokenizer.encode("Hello, wörld! <eos>", add_special_tokens=False)).encode())
    h.update(
        tiny.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        ).encode()
    )
    assert h.hexdigest() == a


def test_tiny_seed_changes_weights_and_shapes_follow_spec() -> None:
    spec = TinyModelSpec(seed=1, hidden_size=32, num_heads=4, num_kv_heads=1, num_layers=3, vocab_size=300)
    m = load(spec)
    assert m.hidden_size == 32 and m.vocab_size == 300 and len(m.model.model.layers) == 3
    w0 = load(TinyModelSpec(seed=0)).model.model.embed_tokens.weight
    w1 = load(TinyModelSpec(seed=1)).model.model.embed_tokens.weight
    assert not torch.equal(w0, w1)
    assert abs(float(w0.std()) - 0.02) < 0.002
    assert m.eos_token_ids == (2,) and m.max_context == spec.max_position_embeddings


def test_tiny_tokenizer_roundtrip_and_specials() -> None:
    tok = build_tiny_tokenizer(512)
    text = "Grüße, 世界! \n\t<x>"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(3 <= i < 259 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.bos_token_id == 1
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<bos>user\nhi<eos>\n<bos>assistant\n"
    assert tok.encode("<eos>", add_special_tokens=False) == [2]
    with pytest.raises(ModelError):
        build_tiny_tokenizer(100)


def test_bf16_load(tiny_bf16: LoadedModel) -> None:
    assert tiny_bf16.dtype == torch.bfloat16
    with pytest.raises(ModelError):
        load(TinyModelSpec(), dtype="float16")


def test_hf_local_directory_loads_same_logits(tiny: LoadedModel, tmp_path: Path) -> None:
    save_checkpoint(tiny.model, tiny.tokenizer, tmp_path / "ckpt")
    again = load(HFModelSpec(name_or_path=str(tmp_path / "ckpt")))
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.inference_mode():
        assert torch.equal(tiny.model(ids).logits, again.model(ids).logits)
    assert again.eos_token_ids == tiny.eos_token_ids
    assert again.tokenizer.encode("abc", add_special_tokens=False) == tiny.tokenizer.encode(
        "abc", add_special_tokens=False
    )


def test_missing_path_is_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError):
        load(HFModelSpec(name_or_path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError):
        load(HFModelSpec(name_or_path=str(tmp_path / "empty")))
