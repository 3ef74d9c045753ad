"""Forward pass: prefill vs incremental decode agree (fp32 tight, bf16 within bf16 tolerance)."""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel
from models.forward import decode, prefill
from protocol.errors import ModelError


def _seq(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill_vs_decode(m: LoadedModel, split: int, total: int) -> tuple[torch.Tensor, ...]:
    ids = _seq(total)
    full = prefill(m, ids)
    state = prefill(m, ids[:, :split], use_cache=True)
    hiddens, logits = [state.hidden], [state.logits]
    for i in range(split, total):
        state = decode(m, ids[:, i : i + 1], state)
        hiddens.append(state.hidden)
        logits.append(state.logits)
    return full.hidden, torch.cat(hiddens, 1), full.logits, torch.cat(logits, 1)


def test_prefill_matches_decode_fp32(tiny: LoadedModel) -> None:
    h_full, h_inc, l_full, l_inc = _prefill_vs_decode(tiny, 5, 40)
    assert h_full.shape == (1, 40, tiny.hidden_size) and l_full.shape == (1, 40, tiny.vocab_size)
    assert h_full.dtype == torch.float32 and l_full.dtype == torch.float32
    torch.testing.assert_close(h_inc, h_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l_inc, l_full, rtol=1e-5, atol=1e-5)


def test_prefill_matches_decode_bf16(tiny_bf16: LoadedModel) -> None:
    h_full, h_inc, l_full, l_inc = _prefill_vs_decode(tiny_bf16, 5, 40)
    assert h_full.dtype == torch.bfloat16 and l_full.dtype == torch.float32
    torch.testing.assert_close(h_inc.float(), h_full.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(l_inc, l_full, rtol=2e-2, atol=2e-2)


def test_hidden_is_final_norm_output_and_logits_its_projection(tiny: LoadedModel) -> None:
    ids = _seq(12)
    out = prefill(tiny, ids)
    with torch.inference_mode():
        ref = tiny.model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits.float())
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_single_sequences(tiny: LoadedModel, side: str) -> None:
    seqs = [_seq(n, seed=n)[0] for n in (7, 15, 3)]
    width = 15
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    batch = prefill(tiny, ids, mask)
    for i, s in enumerate(seqs):
        alone = prefill(tiny, s[None])
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        torch.testing.assert_close(batch.hidden[i, sl], alone.hidden[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.logits[i, sl], alone.logits[0], rtol=1e-5, atol=1e-5)


def test_context_overflow_and_bad_input(tiny: LoadedModel) -> None:
    with pytest.raises(ModelError, match="context"):
        prefill(tiny, _seq(tiny.max_context + 1))
    state = prefill(tiny, _seq(tiny.max_context - 1), use_cache=True, logits_last_only=True)
    assert state.logits.shape == (1, 1, tiny.vocab_size)
    state = decode(tiny, torch.tensor([[5]]), state)  # exactly at the limit: fine
    with pytest.raises(ModelError, match="context"):
        decode(tiny, torch.tensor([[5]]), state)
    with pytest.raises(ModelError):
        prefill(tiny, torch.tensor([[1, tiny.vocab_size]]))
    with pytest.raises(ModelError):
        prefill(tiny, torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ModelError):
        decode(tiny, torch.tensor([[5]]), prefill(tiny, _seq(4)))
