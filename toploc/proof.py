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
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ProofError
from toploc.field import PRIME, evaluate, injective_modulus, interpolate

if TYPE_CHECKING:
    import torch

_MAX_INDEX = 2**63 - 1


def _ints(values: Iterable[SupportsIndex], what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes, bytearray)):
        raise ProofError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise ProofError(f"{what} must be a sequence of ints: {exc}") from None


class ProofPoly:
    """The interpolating polynomial of one chunk: ascending coefficients and the index modulus.

    Validated on construction (`ProofError`): at least one coefficient, each in [0, 65497), and a
    modulus in [len(coeffs), 65497] (the range the modulus search can produce). The one exception
    is `ProofPoly.null(k)` (modulus 0, all zeros), the reference's failure marker: it can be
    serialized, compared and hashed, but evaluating or verifying it raises `ProofError`.

    An immutable value: equal coefficients and modulus compare (and hash) equal however the
    proof was made (list, tuple, bytes). `coeffs` returns a fresh list, like the reference's.
    """

    __slots__ = ("_coeffs", "_modulus")
    _coeffs: tuple[int, ...]
    _modulus: int

    def __init__(self, coeffs: Iterable[SupportsIndex], modulus: SupportsIndex) -> None:
        values = _ints(coeffs, "coeffs")
        try:
            m = operator.index(modulus)
        except TypeError:
            raise ProofError(f"modulus must be an int, got {type(modulus).__name__}") from None
        if not values:
            raise ProofError("a proof needs at least one coefficient")
        if any(not 0 <= c < PRIME for c in values):
            raise ProofError(f"coefficients must be field elements in [0, {PRIME})")
        if not (len(values) <= m <= PRIME or (m == 0 and not any(values))):
            raise ProofError(f"modulus {m} outside [{len(values)}, {PRIME}] (and not a null proof)")
        object.__setattr__(self, "_coeffs", values)
        object.__setattr__(self, "_modulus", m)

    @property
    def coeffs(self) -> list[int]:
        """k coefficients in [0, 65497), lowest power first (a copy)."""
        return list(self._coeffs)

    @property
    def modulus(self) -> int:
        """Flat top-k indices are reduced by this before interpolation (the largest injective one)."""
        return self._modulus

    @property
    def is_null(self) -> bool:
        """Whether this is the reference's null proof (modulus 0), which proves nothing."""
        return self._modulus == 0

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ProofPoly is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ProofPoly is immutable (cannot delete {name!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProofPoly):
            return NotImplemented
        return self._modulus == other._modulus and self._coeffs == other._coeffs

    def __hash__(self) -> int:
        return hash((self._coeffs, self._modulus))

    def __repr__(self) -> str:
        return f"ProofPoly[{self._modulus}]({list(self._coeffs)})"  # the reference's format

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProofPoly, (self._coeffs, self._modulus))

    def __len__(self) -> int:
        return len(self._coeffs)

    def __call__(self, x: SupportsIndex) -> int:
        """Evaluate at x (reduced by the modulus first, unlike the reference's `__call__`)."""
        if self.is_null:
            raise ProofError("a null proof cannot be evaluated")
        xv = operator.index(x)
        arr = np.asarray([[xv % self._modulus]], dtype=np.int64)
        return int(evaluate(np.asarray([self._coeffs], dtype=np.int64), arr)[0, 0])

    def to_bytes(self) -> bytes:
        return encode_proofs(np.asarray([self._coeffs], dtype=np.int64), np.asarray([self._modulus]))[0]

    def to_base64(self) -> str:
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @staticmethod
    def from_bytes(data: bytes, topk: int | None = None) -> ProofPoly:
        """Parse one proof (a null proof is refused: it is not a proof of anything)."""
        coeffs, moduli = decode_proofs([data], topk if topk is not None else max(0, (len(data) - 2) // 2))
        return ProofPoly(coeffs[0].tolist(), int(moduli[0]))

    @staticmethod
    def from_base64(text: str, topk: int | None = None) -> ProofPoly:
        return ProofPoly.from_bytes(decode_base64(text), topk)

    @staticmethod
    def null(length: int) -> ProofPoly:
        """The reference's failure marker: `length` zero coefficients, modulus 0.

        Provided so code written for the reference can name it (e.g. to recognise a failed
        prover's output); this package never returns one (it raises `ProofError` instead), and
        `from_bytes` and the verifiers refuse it.
        """
        if operator.index(length) < 1:
            raise ProofError(f"a proof needs at least one coefficient, got length {length}")
        return ProofPoly((0,) * operator.index(length), 0)

    @staticmethod
    def from_points(x: Sequence[SupportsIndex], y: Sequence[SupportsIndex]) -> ProofPoly:
        """The proof through points (x_i, y_i): x reduced by `find_injective_modulus(x)`, then
        interpolated over GF(65497).

        x: distinct non-negative ints (flat indices); y: 16-bit values (bf16 bit patterns), taken
        mod 65497 as every proof does (so patterns >= 65497, negative NaNs, alias).
        """
        xs, ys = _ints(x, "x"), _ints(y, "y")
        if len(xs) != len(ys):
            raise ProofError(f"x and y differ in length ({len(xs)} vs {len(ys)})")
        if any(not 0 <= v < 1 << 16 for v in ys):
            raise ProofError("y values must be 16-bit (in [0, 65536))")
        modulus = find_injective_modulus(xs)
        x_arr = np.asarray([xs], dtype=np.int64) % modulus
        coeffs = interpolate(x_arr, np.asarray([ys], dtype=np.int64))
        return ProofPoly(coeffs[0].tolist(), modulus)

    @staticmethod
    def from_points_tensor(x: torch.Tensor, y: torch.Tensor) -> ProofPoly:
        """`from_points` from 1-D tensors: x int32/int64 indices; y bfloat16 values (their bit
        patterns are interpolated) or an integer tensor of 16-bit values.

        float16 and float32 are refused: proofs are verified as bfloat16, so an fp16 proof could be
        built but never checked (the reference builds them and then cannot verify them).
        """
        import torch

        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ProofError("x and y must be tensors")
        if x.dim() != 1 or y.dim() != 1:
            raise ProofError(f"x and y must be 1-D, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
        if x.dtype not in (torch.int32, torch.int64):
            raise ProofError(f"x must be an int32 or int64 tensor, got {x.dtype}")
        if y.dtype == torch.bfloat16:
            y_vals = (y.detach().cpu().view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
        elif y.dtype in (torch.int16, torch.int32, torch.int64, torch.uint8, torch.int8):
            y_vals = y.detach().cpu().to(torch.int64).tolist()
        else:
            raise ProofError(f"y must be bfloat16 or an integer tensor, got {y.dtype}")
        return ProofPoly.from_points(x.detach().cpu().tolist(), y_vals)


def find_injective_modulus(x: Sequence[SupportsIndex]) -> int:
    """The largest m <= 65497 for which the values of `x` stay distinct mod m.

    The search order of the reference's builder (its C++ `from_points`), down to len(x); its Python
    helper of this name stops at 2**15 + 1 and raises below. `ProofError` if `x` is empty, has
    negative or duplicate values, or values beyond int64.
    """
    xs = _ints(x, "x")
    if not xs:
        raise ProofError("x is empty")
    if any(not 0 <= v <= _MAX_INDEX for v in xs):
        raise ProofError("x values must be non-negative int64 indices")
    if len(set(xs)) != len(xs):
        raise ProofError("x values are not distinct: no modulus keeps them apart")
    return int(injective_modulus(np.asarray([xs], dtype=np.int64))[0])


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
