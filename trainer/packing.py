"""Sequence packing: several samples share one fixed-length row without attending to each other.

Each row carries per-token segment ids and position ids that restart at 0 for every sample. The
attention mask handed to the model is a 4D additive block-diagonal causal mask, built from the segment
ids, so packing works with every attention implementation (eager, sdpa) on CPU as on GPU; Hugging Face
models use a 4D mask as given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.rollout_files import Sample


@dataclass
class PackedRows:
    """Tensors of shape [rows, seq_len]; weights are 0 on prompt and padding tokens."""

    input_ids: torch.Tensor  # [R, L] int64
    position_ids: torch.Tensor  # [R, L] int64
    segment_ids: torch.Tensor  # [R, L] int64, padding gets -1
    sampling_logprobs: torch.Tensor  # [R, L] float32, logprob of token t under the behaviour policy
    advantages: torch.Tensor  # [R, L] float32
    weights: torch.Tensor  # [R, L] float32, normalization weight of each loss token

    @property
    def useful_tokens(self) -> int:
        return int((self.segment_ids >= 0).sum())

    @property
    def processed_tokens(self) -> int:
        return int(self.segment_ids.numel())

    def select(self, rows: Sequence[int]) -> PackedRows:
        """Those rows, cut to the longest one's used length: trailing padding is never computed."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        seg = self.segment_ids.index_select(0, idx)
        used = int(((seg >= 0).sum(dim=1)).max()) if len(rows) else 0
        width = max(used, 2)
        return PackedRows(*(t.index_select(0, idx)[:, :width] for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids,
            self.position_ids,
            self.segment_ids,
            self.sampling_logprobs,
            self.advantages,
            self.weights,
        )


def plan_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing bin packing of sample lengths into rows of `seq_len` tokens.

    Deterministic: ties are broken by sample index, so the same batch always packs the same way (exact
    resume depends on it).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > seq_len:
            raise ValueError(f"sample of {n} tokens does not fit seq_len {seq_len}")
        for r, f in enumerate(free):
            if n <= f:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    return rows


def pack(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    weights: Sequence[float],
    seq_len: int,
    pad_token_id: int = 0,
) -> PackedRows:
    """Pack samples into rows; `advantages` and `weights` are per sample, spread over its loss tokens."""
    return _pack([s.tokens for s in samples], [s.loss_mask for s in samples],
                 [s.sampling_logprobs for s in samples], advantages, weights, seq_len, pad_token_id)


def pack_examples(
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]],
    weights: Sequence[float],
    seq_len: int,
    pad_token_id: int = 0,
) -> PackedRows:
    """Pack supervised examples (no behaviour policy): advantages are 1 and sampling logprobs 0 on loss tokens."""
    zeros = [(0.0,) * len(t) for t in tokens]
    return _pack(tokens, loss_masks, zeros, [1.0] * len(tokens), weights, seq_len, pad_token_id)


def _pack(
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]],
    sampling_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    weights: Sequence[float],
    seq_len: int,
    pad_token_id: int,
) -> PackedRows:
    plan = plan_rows([len(t) for t in tokens], seq_len)
    shape = (len(plan), seq_len)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    slp = torch.zeros(shape, dtype=torch.float32)
    adv = torch.zeros(shape, dtype=torch.float32)
    w = torch.zeros(shape, dtype=torch.float32)
    for r, members in enumerate(plan):
        off = 0
        for seg, i in enumerate(members):
            n = len(tokens[i])
            sl = slice(off, off + n)
            input_ids[r, sl] = torch.tensor(tokens[i], dtype=torch.long)
            position_ids[r, sl] = torch.arange(n)
            segment_ids[r, sl] = seg
            mask = torch.tensor(loss_masks[i], dtype=torch.bool)
            slp[r, sl] = torch.tensor(sampling_logprobs[i], dtype=torch.float32) * mask
            adv[r, sl] = float(advantages[i]) * mask
            w[r, sl] = float(weights[i]) * mask
            off += n
        # Padding continues the position count so every query row has at least itself to attend to.
        position_ids[r, off:] = torch.arange(seq_len - off)
    return PackedRows(input_ids, position_ids, segment_ids, slp, adv, w)


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [R, 1, L, L]: 0 where query i may see key j (same segment, j <= i), else -inf-ish."""
    L = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def packed_attention_mask(model: torch.nn.Module, segment_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask in the form the model's attention implementation takes."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "eager")
    if impl == "sdpa":
        # SDPA takes a boolean mask (True = attend), which is also dtype-proof under autocast.
        L = segment_ids.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=segment_ids.device).tril()
        return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]
    return block_causal_mask(segment_ids, next(model.parameters()).dtype)


def selected_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    select: torch.Tensor,
) -> torch.Tensor:
    """Log-probs [N] of the tokens where `select` [R, L] (bool) is True, in row-major order.

    Only the positions that predict a selected token go through the LM head and the softmax (Hugging
    Face's boolean `logits_to_keep`): for supervised loss on completions that skips the head on every
    prompt token, about a fifth of a small model's compute. Token 0 of a row cannot be selected.
    """
    if bool(select[:, 0].any()):
        raise ValueError("the first token of a row has no prediction")
    keep = torch.zeros_like(select)
    keep[:, :-1] = select[:, 1:]  # position t predicts token t + 1
    mask = packed_attention_mask(model, segment_ids)
    n = int(keep.sum())
    try:
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                       logits_to_keep=keep).logits
    except IndexError:  # transformers before boolean logits_to_keep (5.17 indexes with it as a slice)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    if logits.dim() != 2 or logits.shape[0] != n:  # a model without boolean logits_to_keep gave them all
        logits = logits[keep]
    logits = logits.float()
    targets = input_ids[select]
    picked: torch.Tensor = logits.gather(-1, targets[:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its own sample's prefix, aligned with `input_ids` (0 at position 0).

    Returns (logprobs [R, L], entropy [R, L] or None); the entropy at t is that of the distribution that
    produced token t.
    """
    mask = packed_attention_mask(model, segment_ids)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    lp = torch.cat([lp[:, :1], picked - lse], dim=1)
    ent: torch.Tensor | None = None
    if with_entropy:
        src, src_lse = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        p = torch.softmax(src, dim=-1)
        e = src_lse - (p * src).sum(-1)
        ent = torch.cat([torch.zeros_like(e[:, :1]), e], dim=1)
    return lp, ent
