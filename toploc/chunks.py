"""Chunking of activations and top-k selection, with the reference's semantics.

`activations` is a 2-D tensor (rows = positions) or a list of tensors. Without `skip_prefill` the
first element (`activations[0]`: the whole prefill when a list, the first row when a tensor) is its
own chunk; the rest is grouped `decode_batching_size` elements at a time, each group flattened in
order. The top-k is taken over |values| of the flattened chunk with `torch.topk` (same call as the
reference, so ties at the k-th value break the same way on the same torch build).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ProofError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

def _check_args(decode_batching_size: int, topk: int) -> None:
    if not isinstance(decode_batching_size, int) or decode_batching_size < 1:
        raise ProofError(f"decode_batching_size must be a positive int, got {decode_batching_size!r}")
    if not isinstance(topk, int) or topk < 1:
        raise ProofError(f"topk must be a positive int, got {topk!r}")


def split_chunks(
    activations: torch.Tensor | Sequence[torch.Tensor], decode_batching_size: int, skip_prefill: bool
) -> list[torch.Tensor]:
    """Flattened bf16 chunks, in proof order (see the module docstring)."""
    return _chunks(activations, decode_batching_size, skip_prefill, bf16_only=True)


def batch_activations(
    activations: torch.Tensor | Sequence[torch.Tensor], decode_batching_size: int, skip_prefill: bool = False
) -> list[torch.Tensor]:
    """The reference's name for the chunking: flattened chunks in proof order, any dtype.

    Same chunks as the proof functions use; `ProofError` on empty or non-tensor input.
    """
    if not isinstance(decode_batching_size, int) or decode_batching_size < 1:
        raise ProofError(f"decode_batching_size must be a positive int, got {decode_batching_size!r}")
    return _chunks(activations, decode_batching_size, skip_prefill, bf16_only=False)


def _chunks(
    activations: torch.Tensor | Sequence[torch.Tensor], decode_batching_size: int, skip_prefill: bool,
    *, bf16_only: bool,
) -> list[torch.Tensor]:
    import torch

    tensor: torch.Tensor | None = None
    items: list[torch.Tensor] = []
    if isinstance(activations, torch.Tensor):
        if activations.dim() < 1 or activations.shape[0] == 0:
            raise ProofError(f"activations tensor must have at least one row, got shape {tuple(activations.shape)}")
        tensor = activations
        dtypes = {tensor.dtype}
        n = tensor.shape[0]
    elif isinstance(activations, (list, tuple)):
        if not activations:
            raise ProofError("activations list is empty")
        for i, a in enumerate(activations):
            if not isinstance(a, torch.Tensor):
                raise ProofError(f"activations[{i}] must be a tensor, got {type(a).__name__}")
        items = list(activations)
        dtypes = {a.dtype for a in items}
        n = len(items)
    else:
        raise ProofError(f"activations must be a tensor or a list of tensors, got {type(activations).__name__}")
    if bf16_only and dtypes != {torch.bfloat16}:
        raise ProofError(f"activations must be bfloat16, got {sorted(map(str, dtypes))}")

    chunks: list[torch.Tensor] = []
    start = 0
    if not skip_prefill:
        chunks.append((tensor[0] if tensor is not None else items[0]).reshape(-1))
        start = 1
    for i in range(start, n, decode_batching_size):
        if tensor is not None:
            chunks.append(tensor[i : i + decode_batching_size].reshape(-1))
        else:
            chunks.append(torch.cat([a.reshape(-1) for a in items[i : i + decode_batching_size]]))
    return chunks


def topk_points(chunks: Sequence[torch.Tensor], topk: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Top-k of |values| per chunk -> (flat indices (n, k) int64, bf16 bit patterns (n, k) int64).

    Chunks of equal length are stacked and selected with one batched `topk` call.
    """
    import torch

    n = len(chunks)
    indices = np.empty((n, topk), dtype=np.int64)
    bits = np.empty((n, topk), dtype=np.int64)
    by_size: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        if c.numel() < topk:
            raise ProofError(f"chunk {i} has {c.numel()} values, fewer than topk={topk}")
        by_size.setdefault(c.numel(), []).append(i)
    for _, members in by_size.items():
        stacked = chunks[members[0]].unsqueeze(0) if len(members) == 1 else torch.stack([chunks[i] for i in members])
        idx = stacked.abs().topk(topk, dim=-1).indices
        vals = stacked.gather(-1, idx)
        idx_np = idx.cpu().numpy()
        bits_np = vals.cpu().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        indices[members] = idx_np
        bits[members] = bits_np
    return indices, bits
