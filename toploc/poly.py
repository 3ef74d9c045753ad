"""The reference's `toploc.poly` module path, for code written against toploc 0.1.6.

Nothing is defined here: the names live in `toploc.proof`, `toploc.proofs` and `toploc.chunks`
(see toploc/README.md for where behaviour differs, e.g. errors raise `ProofError` instead of
returning null proofs).
"""

from toploc.chunks import batch_activations
from toploc.proof import ProofPoly, find_injective_modulus
from toploc.proofs import (
    VerificationResult,
    build_proofs,
    build_proofs_base64,
    build_proofs_bytes,
    verify_proofs,
    verify_proofs_base64,
    verify_proofs_bytes,
)

__all__ = [
    "ProofPoly",
    "VerificationResult",
    "batch_activations",
    "build_proofs",
    "build_proofs_base64",
    "build_proofs_bytes",
    "find_injective_modulus",
    "verify_proofs",
    "verify_proofs_base64",
    "verify_proofs_bytes",
]
