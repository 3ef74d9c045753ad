"""Build and verify TOPLOC proofs, with the reference `toploc` 0.1.6 names and semantics.

    proofs = build_proofs_bytes(hidden, decode_batching_size=32, topk=128, skip_prefill=True)
    results = verify_proofs_bytes(hidden_recomputed, proofs, decode_batching_size=32, topk=128,
                                  skip_prefill=True)
    results[0].exp_mismatches, results[0].mant_err_mean, results[0].mant_err_median

Measurements, per chunk, as the reference's C++ verifier computes them: the verifier takes the
top-k of its own activations, reduces each flat index by the proof's modulus (every path here;
the reference's Python path forgets to), evaluates the proof polynomial there to get the prover's
bf16 bits, and compares exponents (8 bits) and mantissas (7 bits; the sign is ignored, as in the
reference). `mant_err_median` is the upper median (element len//2 of the sorted errors) like the
reference's C++ path; its Python path averages the two middle values. With no exponent match at
all, mean and median are 2**64.

Errors: anything malformed (activations of the wrong type/dtype/size, proofs of the wrong
length/modulus/count/type) raises `ProofError`; nothing is returned as a "null proof".
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocol.errors import ProofError
from toploc.chunks import _check_args, split_chunks, topk_points
from toploc.field import evaluate, injective_modulus, interpolate
from toploc.proof import ProofPoly, decode_base64, decode_proofs, encode_proofs, validate_proofs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

NO_MATCH = float(2**64)
"""mant_err_mean/median when no exponent matched (the reference's value)."""


@dataclass(frozen=True)
class VerificationResult:
    """Measurements for one chunk; larger is worse for every field."""

    exp_mismatches: int
    """How many of the k top values have a different bf16 exponent in the proof."""
    mant_err_mean: float
    """Mean |mantissa difference| (7-bit units) over the values whose exponents match."""
    mant_err_median: float
    """Upper median of the same differences."""


def _build_arrays(
    activations: torch.Tensor | Sequence[torch.Tensor], decode_batching_size: int, topk: int, skip_prefill: bool
) -> tuple[np.ndarray, np.ndarray]:
    _check_args(decode_batching_size, topk)
    chunks = split_chunks(activations, decode_batching_size, skip_prefill)
    indices, bits = topk_points(chunks, topk)
    moduli = injective_modulus(indices)
    coeffs = interpolate(indices % moduli[:, None], bits)
    return coeffs, moduli


def build_proofs(
    activations: torch.Tensor | Sequence[torch.Tensor],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[ProofPoly]:
    """One proof per chunk (see `toploc.chunks` for how chunks are formed)."""
    coeffs, moduli = _build_arrays(activations, decode_batching_size, topk, skip_prefill)
    return [ProofPoly(row, m) for row, m in zip(coeffs.tolist(), moduli.tolist(), strict=True)]


def build_proofs_bytes(
    activations: torch.Tensor | Sequence[torch.Tensor],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[bytes]:
    """Proofs in the reference byte format (2 + 2 * topk bytes each)."""
    coeffs, moduli = _build_arrays(activations, decode_batching_size, topk, skip_prefill)
    return encode_proofs(coeffs, moduli)


def build_proofs_base64(
    activations: torch.Tensor | Sequence[torch.Tensor],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[str]:
    return [base64.b64encode(p).decode("ascii") for p in build_proofs_bytes(
        activations, decode_batching_size, topk, skip_prefill)]


def _verify_arrays(
    activations: torch.Tensor | Sequence[torch.Tensor],
    coeffs: np.ndarray,
    moduli: np.ndarray,
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool,
) -> list[VerificationResult]:
    chunks = split_chunks(activations, decode_batching_size, skip_prefill)
    if len(chunks) != coeffs.shape[0]:
        raise ProofError(f"got {coeffs.shape[0]} proofs for {len(chunks)} chunks")
    indices, bits = topk_points(chunks, topk)
    claimed = evaluate(coeffs, indices % moduli[:, None])  # the prover's bf16 bits, per point
    exp_mine, mant_mine = (bits >> 7) & 0xFF, bits & 0x7F
    exp_claimed, mant_claimed = (claimed >> 7) & 0xFF, claimed & 0x7F
    mismatch = exp_mine != exp_claimed
    n_mismatch = mismatch.sum(axis=1)
    errs = np.abs(mant_mine - mant_claimed)
    n_match = topk - n_mismatch
    sums = np.where(mismatch, 0, errs).sum(axis=1)
    # Upper median: push mismatched entries past every real error (max 127), sort, pick len//2.
    ordered = np.sort(np.where(mismatch, 1 << 20, errs), axis=1)
    pick = np.minimum(n_match // 2, topk - 1)
    medians = np.take_along_axis(ordered, pick[:, None], axis=1)[:, 0]
    results = []
    for mm, nm, s, med in zip(n_mismatch.tolist(), n_match.tolist(), sums.tolist(), medians.tolist(), strict=True):
        if nm == 0:
            results.append(VerificationResult(mm, NO_MATCH, NO_MATCH))
        else:
            results.append(VerificationResult(mm, s / nm, float(med)))
    return results


def _check_count(
    activations: torch.Tensor | Sequence[torch.Tensor], n_proofs: int, decode_batching_size: int, skip_prefill: bool
) -> None:
    """Reject a wrong number of proofs before decoding any (a peer may send a huge list)."""
    import torch

    if isinstance(activations, torch.Tensor) and activations.dim() >= 1:
        n = activations.shape[0]
    elif isinstance(activations, (list, tuple)):
        n = len(activations)
    else:
        return  # split_chunks raises the precise error
    rest = n if skip_prefill else max(0, n - 1)
    expected = (0 if skip_prefill else 1) + -(-rest // decode_batching_size)
    if n and n_proofs != expected:
        raise ProofError(f"got {n_proofs} proofs for {expected} chunks")


def verify_proofs(
    activations: torch.Tensor | Sequence[torch.Tensor],
    proofs: Sequence[ProofPoly],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[VerificationResult]:
    """Per-chunk measurements of `proofs` against the verifier's own `activations`."""
    _check_args(decode_batching_size, topk)
    for i, p in enumerate(proofs):
        if not isinstance(p, ProofPoly):
            raise ProofError(f"proof {i} must be a ProofPoly, got {type(p).__name__}")
        if p.is_null:
            raise ProofError(f"proof {i} is a null proof (the reference's failure marker), not a proof")
        if len(p) != topk:
            raise ProofError(f"proof {i} has {len(p)} coefficients, expected topk={topk}")
    coeffs, moduli = validate_proofs(
        np.asarray([p.coeffs for p in proofs], dtype=np.int64).reshape(len(proofs), topk),
        np.asarray([p.modulus for p in proofs], dtype=np.int64),
        topk,
    )
    return _verify_arrays(activations, coeffs, moduli, decode_batching_size, topk, skip_prefill)


def verify_proofs_bytes(
    activations: torch.Tensor | Sequence[torch.Tensor],
    proofs: Sequence[bytes],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[VerificationResult]:
    _check_args(decode_batching_size, topk)
    if isinstance(proofs, (bytes, str)) or not isinstance(proofs, Sequence):
        raise ProofError(f"proofs must be a list of bytes, got {type(proofs).__name__}")
    _check_count(activations, len(proofs), decode_batching_size, skip_prefill)  # before parsing any
    coeffs, moduli = decode_proofs(list(proofs), topk)
    return _verify_arrays(activations, coeffs, moduli, decode_batching_size, topk, skip_prefill)


def verify_proofs_base64(
    activations: torch.Tensor | Sequence[torch.Tensor],
    proofs: Sequence[str],
    decode_batching_size: int,
    topk: int,
    skip_prefill: bool = False,
) -> list[VerificationResult]:
    _check_args(decode_batching_size, topk)
    if isinstance(proofs, (bytes, str)) or not isinstance(proofs, Sequence):
        raise ProofError(f"proofs must be a list of base64 strings, got {type(proofs).__name__}")
    _check_count(activations, len(proofs), decode_batching_size, skip_prefill)
    return verify_proofs_bytes(activations, [decode_base64(p) for p in proofs], decode_batching_size, topk,
                               skip_prefill)
