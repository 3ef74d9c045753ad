"""The reference forward pass: logits and final hidden states, for prefill and incremental decode.

"Final hidden state" means the output of the model's final norm, before the LM head, in the
model's dtype: the tensor TOPLOC proves. Verifiers run ``prefill`` over whole sequences (prompt +
completion); the hidden state at position ``p`` is the one from which token ``p + 1`` was sampled.
``decode`` continues from a KV cache, one or more tokens at a time; both go through the Hugging
Face module (``model.model``) and apply the LM head here, so they work for any causal LM that
transformers loads.

Padding: pass ``attention_mask`` (1 = real token). Positions are counted over real tokens only,
so left- and right-padded batches give every sequence the same positions as when run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache

from models.loading import LoadedModel, output_head
from protocol.errors import ModelError


@dataclass
class ForwardOutput:
    logits: torch.Tensor
    """[B, T, V] float32 (only the positions asked for)."""
    hidden: torch.Tensor
    """[B, T, H] final hidden states (after the final norm) in the model dtype."""
    cache: Cache | None
    """KV cache to continue with ``decode`` (None unless asked for)."""
    attention_mask: torch.Tensor
    """[B, past + T] mask covering everything in the cache, to extend on the next ``decode``."""


def check_context(loaded: LoadedModel, length: int) -> None:
    """Raise ``ModelError`` when a sequence of ``length`` tokens does not fit the model."""
    if length > loaded.max_context:
        raise ModelError(f"sequence of {length} tokens exceeds the model's context of {loaded.max_context}")


def left_pad(prompts: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompts` as one left-padded batch on `device`: (token ids, the mask of real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = True
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _run(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: Cache | None,
    use_cache: bool,
    logits_last_only: bool,
) -> ForwardOutput:
    new = input_ids.shape[1]
    check_context(loaded, mask.shape[1])
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= loaded.vocab_size:
        raise ModelError(f"token ids outside the vocabulary [0, {loaded.vocab_size})")
    positions = _positions(mask)[:, -new:]
    if use_cache and cache is None:
        cache = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        out = loaded.model.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        head_in = hidden[:, -1:] if logits_last_only else hidden
        logits = output_head(loaded.model)(head_in).float()
    return ForwardOutput(logits, hidden, out.past_key_values if use_cache else None, mask)


def prefill(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    use_cache: bool = False,
    logits_last_only: bool = False,
) -> ForwardOutput:
    """Run whole sequences [B, T] (padded, with ``attention_mask``) in one pass."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ModelError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    device = loaded.device
    input_ids = input_ids.to(device)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    if mask.shape != input_ids.shape:
        raise ModelError(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    return _run(loaded, input_ids, mask, None, use_cache, logits_last_only)


def decode(loaded: LoadedModel, input_ids: torch.Tensor, previous: ForwardOutput) -> ForwardOutput:
    """Continue ``previous`` (which holds a cache) with new tokens [B, T_new]."""
    if previous.cache is None:
        raise ModelError("decode needs the cache of a prefill or decode run with use_cache=True")
    input_ids = input_ids.to(loaded.device)
    extra = torch.ones_like(input_ids, dtype=previous.attention_mask.dtype)
    mask = torch.cat([previous.attention_mask, extra], dim=1)
    return _run(loaded, input_ids, mask, previous.cache, True, False)
