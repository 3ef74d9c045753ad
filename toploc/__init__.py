"""TOPLOC proofs of inference (reference byte format) plus exact sampling and termination checks.

Measurements only: `ToplocThresholds` holds the limits a validator applies. torch is imported
lazily by the functions that take tensors.
"""

from toploc.chunks import batch_activations
from toploc.digest import sha256sum
from toploc.field import PRIME
from toploc.proof import ProofPoly, find_injective_modulus
from toploc.proofs import (
    NO_MATCH,
    VerificationResult,
    build_proofs,
    build_proofs_base64,
    build_proofs_bytes,
    verify_proofs,
    verify_proofs_base64,
    verify_proofs_bytes,
)
from toploc.sampling_check import SamplingCheck, TerminationCheck, check_sampling, check_termination
from toploc.thresholds import ToplocThresholds

__all__ = [
    "NO_MATCH",
    "PRIME",
    "ProofPoly",
    "SamplingCheck",
    "TerminationCheck",
    "ToplocThresholds",
    "VerificationResult",
    "batch_activations",
    "build_proofs",
    "build_proofs_base64",
    "build_proofs_bytes",
    "check_sampling",
    "check_termination",
    "find_injective_modulus",
    "sha256sum",
    "verify_proofs",
    "verify_proofs_base64",
    "verify_proofs_bytes",
]
