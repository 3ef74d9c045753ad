"""One TOPLOC proof: a polynomial over GF(65497) and its 2 + 2k byte wire format.

Byte format (the reference `toploc` 0.1.6, `ProofPoly.to_bytes`): the modulus as a big-endian
uint16, then the k coefficients (ascending powers) each as a big-endian uint16. 258 bytes at k=128.
Base64 is standard RFC 4648 with padding.

Parsing is strict where the reference is lenient: a wrong length, a modulus that cannot be the
output of the modulus search (0, below k, above 65497), a non-canonical coefficient (>= 65497),
a non-bytes value or invalid base64 raise `ProofError` (the reference crashes on modulus 0 and
silently drops a trailing odd byte).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ProofError
from toploc.field import PRIME, evaluate


@dataclass(frozen=True, eq=True)
class ProofPoly:
    """The interpolating polynomial of one chunk: ascending coefficients and the index modulus."""

    coeffs: tuple[int, ...]
    """k coefficients in [0, 65497), lowest power first."""
    modulus: int
    """Flat top-k indices are reduced by this before interpolation (the largest injective one)."""

    def __len__(self) -> int:
        return len(self.coeffs)

    def __call__(self, x: int) -> int:
        """Evaluate at x (reduced by the modulus first, unlike the reference's `__call__`)."""
        arr = np.asarray([[x % self.modulus]], dtype=np.int64)
        return int(evaluate(np.asarray([self.coeffs], dtype=np.int64), arr)[0, 0])

    def to_bytes(self) -> bytes:
        return encode_proofs(np.asarray([self.coeffs], dtype=np.int64), np.asarray([self.modulus]))[0]

    def to_base64(self) -> str:
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @staticmethod
    def from_bytes(data: bytes, topk: int | None = None) -> ProofPoly:
        coeffs, moduli = decode_proofs([data], topk if topk is not None else max(0, (len(data) - 2) // 2))
        return ProofPoly(tuple(int(c) for c in coeffs[0]), int(moduli[0]))

    @staticmethod
    def from_base64(text: str, topk: int | None = None) -> ProofPoly:
        return ProofPoly.from_bytes(decode_base64(text), topk)


def encode_proofs(coeffs: NDArray[np.int64], moduli: NDArray[np.int64]) -> list[bytes]:
    """Serialize a batch: coeffs (n, k), moduli (n,) -> n byte strings of 2 + 2k bytes."""
    n, k = coeffs.shape
    words = np.empty((n, k + 1), dtype=">u2")
    words[:, 0] = moduli
    words[:, 1:] = coeffs
    raw = words.tobytes()
    size = 2 * (k + 1)
    return [raw[i * size : (i + 1) * size] for i in range(n)]


def decode_base64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ProofError(f"a base64 proof must be a str, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise ProofError(f"invalid base64 proof: {exc}") from None


def decode_proofs(proofs: Sequence[object], topk: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Parse and validate n proofs of k = `topk` coefficients -> (coeffs (n, k), moduli (n,))."""
    if topk < 1:
        raise ProofError(f"topk must be >= 1, got {topk}")
    size = 2 * (topk + 1)
    for i, p in enumerate(proofs):
        if not isinstance(p, (bytes, bytearray, memoryview)):
            raise ProofError(f"proof {i} must be bytes, got {type(p).__name__}")
        if len(p) != size:
            raise ProofError(f"proof {i} has {len(p)} bytes, expected {size} (topk={topk})")
    if not proofs:
        return np.zeros((0, topk), dtype=np.int64), np.zeros(0, dtype=np.int64)
    raw = b"".join(bytes(p) for p in proofs)  # type: ignore[call-overload]  # types checked above
    words = np.frombuffer(raw, dtype=">u2").reshape(len(proofs), topk + 1)
    words = words.astype(np.int64)
    return validate_proofs(words[:, 1:], words[:, 0], topk)


def validate_proofs(
    coeffs: NDArray[np.int64], moduli: NDArray[np.int64], topk: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Check shapes and ranges of parsed proofs; return them unchanged or raise ProofError."""
    if coeffs.ndim != 2 or coeffs.shape[1] != topk or moduli.shape != (coeffs.shape[0],):
        raise ProofError(f"proofs must have {topk} coefficients each, got shape {coeffs.shape}")
    bad = np.flatnonzero((moduli < topk) | (moduli > PRIME))
    if bad.size:
        i = int(bad[0])
        raise ProofError(f"proof {i} has modulus {int(moduli[i])}, outside [{topk}, {PRIME}]")
    bad = np.flatnonzero(((coeffs < 0) | (coeffs >= PRIME)).any(axis=1))
    if bad.size:
        raise ProofError(f"proof {int(bad[0])} has a coefficient >= {PRIME} (not a field element)")
    return coeffs, moduli
