"""Fixtures for trainer tests: a real tiny LLaMA-shaped transformer, one torch thread (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


def tiny_llama(seed: int = 0, vocab_size: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_model() -> torch.nn.Module:
    return tiny_llama()
