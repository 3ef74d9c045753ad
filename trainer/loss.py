"""The GRPO objective: group-relative advantages, online filtering and the clipped token loss.

The token loss is INTELLECT-2's two-sided clipping: the usual PPO clip to [1 - eps_low, 1 + eps_high],
plus a cap `delta` (> 1 + eps_high) on the importance ratio for tokens with a negative advantage.
Without the cap, `-min(r * A, clip(r) * A)` grows without bound in `r` when `A < 0`, and a single very
off-policy token (stale sample, numerical mismatch between engines) can dominate the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], std_normalize: bool = False, eps: float = 1e-6
) -> list[float]:
    """Reward minus its group's mean (optionally divided by the group's std), one value per sample."""
    if len(rewards) != len(group_ids):
        raise ValueError("rewards and group_ids differ in length")
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in groups.values():
        vals = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
        centred = vals - vals.mean()
        if std_normalize and len(idx) > 1:
            # Population std, as GRPO implementations use; eps keeps all-equal groups at exactly zero.
            centred = centred / (vals.std(unbiased=False) + eps)
        for j, i in enumerate(idx):
            out[i] = float(centred[j])
    return out


def zero_advantage_groups(advantages: Sequence[float], group_ids: Sequence[str], tol: float = 1e-9) -> set[str]:
    """Groups whose every sample has (numerically) zero advantage: they carry no learning signal."""
    signal: dict[str, bool] = {}
    for a, g in zip(advantages, group_ids, strict=True):
        signal[g] = signal.get(g, False) or abs(a) > tol
    return {g for g, has in signal.items() if not has}


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the token loss (see `trainer.config.LossSettings` for the documented fields)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    delta: float = 4.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


@dataclass
class LossTerms:
    """The scalar loss to backpropagate plus weighted sums for the step's metrics.

    Every `*_sum` is a sum over loss tokens of `weight * quantity`, so adding the terms of several
    micro-batches (and ranks) gives the step's weighted mean exactly.
    """

    loss: torch.Tensor
    policy_sum: float
    kl_sum: float
    entropy_sum: float
    clipped_low_sum: float
    clipped_high_sum: float
    capped_sum: float
    ratio_sum: float


def grpo_token_loss(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossTerms:
    """Clipped GRPO loss summed over tokens with per-token `weights` (0 off the loss mask).

    All tensors share one shape (tokens of one or more packed rows). `weights` carries the
    normalization: `1 / tokens_in_step` (token mode) or `1 / (len(sample) * samples_in_step)`
    (sequence mode); the returned loss is `sum(weights * per_token_loss)`.
    """
    mask = weights > 0
    log_ratio = (logprobs - sampling_logprobs).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    # The delta cap only binds for A < 0: for A > 0 and r > delta > 1 + eps_high the clipped term
    # (1 + eps_high) * A is already the minimum, so capping r for every token changes nothing there.
    capped = torch.clamp(ratio, max=cfg.delta)
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    per_token = -torch.minimum(capped * advantages, clipped * advantages)
    if ref_logprobs is not None and cfg.kl_coef != 0.0:
        # k3 estimator of KL(pi || ref): unbiased, always >= 0.
        d = (ref_logprobs - logprobs).masked_fill(~mask, 0.0)
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + cfg.kl_coef * kl
    else:
        kl = torch.zeros_like(per_token)
    if entropy is not None and cfg.entropy_coef != 0.0:
        per_token = per_token - cfg.entropy_coef * entropy
    loss = (per_token * weights).sum()

    with torch.no_grad():
        w = weights.detach()
        low = (advantages < 0) & (ratio < 1.0 - cfg.epsilon_low)
        high = (advantages > 0) & (ratio > 1.0 + cfg.epsilon_high)
        cap = (advantages < 0) & (ratio > cfg.delta)
        ent = entropy.detach() if entropy is not None else torch.zeros_like(w)
        return LossTerms(
            loss=loss,
            policy_sum=float((-torch.minimum(capped * advantages, clipped * advantages) * w).sum()),
            kl_sum=float((kl.detach() * w).sum()),
            entropy_sum=float((ent * w).sum()),
            clipped_low_sum=float((low.to(w.dtype) * w).sum()),
            clipped_high_sum=float((high.to(w.dtype) * w).sum()),
            capped_sum=float((cap.to(w.dtype) * w).sum()),
            ratio_sum=float((ratio.detach() * w).sum()),
        )


def token_weights(lengths: Sequence[int], normalization: str) -> list[float]:
    """Per-sample weight for each of its loss tokens, so that the weighted sum is the step's mean.

    `lengths` are the loss-token counts of every sample in the whole step (all micro-batches, all ranks).
    """
    if normalization == "token":
        total = sum(lengths)
        return [1.0 / total if total else 0.0 for _ in lengths]
    if normalization == "sequence":
        n = sum(1 for n_tok in lengths if n_tok > 0)
        return [1.0 / (n_tok * n) if n_tok and n else 0.0 for n_tok in lengths]
    raise ValueError(f"unknown normalization {normalization!r}")
