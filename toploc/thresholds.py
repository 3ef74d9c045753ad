"""The defaults a validator turns measurements into verdicts with (policy lives here, not in the math).

`toploc` only measures; `ToplocThresholds` says where the lines are, and the two helpers below
list which chunks/positions cross them so a validator can record *why*. The validator decides
what a crossing means (reject, slash, log).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from toploc.proofs import VerificationResult
    from toploc.sampling_check import SamplingCheck


class ToplocThresholds(BaseModel):
    """Proof, sampling and termination limits (defaults from INTELLECT-2's TOPLOC settings)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topk: int = Field(default=128, ge=1, le=4096)
    """Values per chunk in a proof (k); a proof is 2 + 2k bytes."""
    decode_batching_size: int = Field(default=32, ge=1)
    """Generated positions per proof chunk."""
    max_exp_mismatches: int = Field(default=38, ge=0)
    """A chunk fails with more than this many exponent mismatches (of topk)."""
    max_mant_err_mean: float = Field(default=10.0, ge=0.0)
    """A chunk fails when the mean mantissa error (7-bit units) is above this."""
    max_mant_err_median: float = Field(default=8.0, ge=0.0)
    """A chunk fails when the upper-median mantissa error is above this."""
    sampling_margin_tolerance: float = Field(default=0.5, ge=0.0)
    """A submitted token counts as a sampling mismatch when the replayed winner's score beats it by
    more than this (in processed-logit units: logits / temperature, plus Gumbel noise). Absorbs
    float differences between the node's decode and the validator's prefill (bf16 on GPUs)."""
    max_sampling_mismatches: int = Field(default=0, ge=0)
    """A sequence fails with more sampling mismatches than this."""

    def failing_chunks(self, results: Sequence[VerificationResult]) -> list[int]:
        """Indices of chunks whose measurements cross a proof threshold."""
        return [
            i
            for i, r in enumerate(results)
            if r.exp_mismatches > self.max_exp_mismatches
            or r.mant_err_mean > self.max_mant_err_mean
            or r.mant_err_median > self.max_mant_err_median
        ]

    def sampling_failed(self, check: SamplingCheck) -> bool:
        """True when the sequence has more mismatched positions than allowed."""
        return len(check.mismatch_positions) > self.max_sampling_mismatches
