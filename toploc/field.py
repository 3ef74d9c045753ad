"""Arithmetic in GF(65497), vectorized over a batch of chunks (numpy only, no torch).

The reference interpolates with Newton divided differences: ~k^2/2 modular inverses per chunk,
sequential in k. Here interpolation uses the Lagrange form written as matrix products, so a whole
batch of chunks costs a fixed number of numpy calls (log-depth product tree + a few batched
matrix-vector products) instead of O(k) Python-level steps:

    M(X) = prod_j (X - x_j) = sum_t m_t X^t                      (product tree, log2(k) levels)
    w_i  = 1 / M'(x_i)                                           (one batched matvec + table lookup)
    g_s  = sum_i (y_i w_i) x_i^s                                 (one batched vecmat)
    c_j  = sum_s g_s m_{s+j+1}                                   (Hankel matvec)

All values stay below p < 2^16, so a product is < 2^32 and a dot product of <= 2^20 terms stays
below 2^52: float64 BLAS matmuls are exact, then reduced mod p.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from protocol.errors import ProofError

PRIME = 65497
"""The field's modulus (the largest prime below 2^16 that the reference uses)."""

Int64Array = NDArray[np.int64]


@lru_cache(maxsize=1)
def inverse_table() -> Int64Array:
    """inv[a] = a^-1 mod p for a in [1, p), inv[0] = 0; Fermat, by vectorized square-and-multiply."""
    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    result[0] = 0
    result.flags.writeable = False
    return result


def _exact_matmul(a: NDArray[np.float64], b: NDArray[np.float64]) -> Int64Array:
    """Batched matmul of residues (exact in float64: see the module docstring), reduced mod p."""
    out: Int64Array = np.fmod(np.matmul(a, b), PRIME).astype(np.int64)
    return out


def power_matrix(x: Int64Array, k: int) -> Int64Array:
    """P[..., i, s] = x_i^s mod p for s in [0, k), by doubling (log2(k) vectorized steps)."""
    out = np.empty((*x.shape, k), dtype=np.int64)
    out[..., 0] = 1
    filled = 1
    step = x % PRIME  # x^filled
    while filled < k:
        n = min(filled, k - filled)
        out[..., filled : filled + n] = out[..., :n] * step[..., None] % PRIME
        filled += n
        if filled < k:
            step = out[..., filled - 1] * (x % PRIME) % PRIME
    return out


def _poly_mul_pairs(polys: Int64Array) -> Int64Array:
    """Multiply polynomials pairwise: (..., 2m, L) coefficient rows -> (..., m, 2L-1), mod p."""
    a = polys[..., 0::2, :]
    b = polys[..., 1::2, :]
    length = a.shape[-1]
    outer = a[..., :, None] * b[..., None, :]  # (..., m, L, L); entries < 2^32
    # Sum anti-diagonals with the pad-and-reshape trick: row i shifted right by i.
    padded = np.zeros((*outer.shape[:-1], 2 * length), dtype=np.int64)
    padded[..., :length] = outer
    flat = padded.reshape(*outer.shape[:-2], 2 * length * length)[..., : length * (2 * length - 1)]
    skewed = flat.reshape(*outer.shape[:-2], length, 2 * length - 1)
    out: Int64Array = skewed.sum(axis=-2) % PRIME
    return out


def master_polynomial(x: Int64Array) -> Int64Array:
    """Coefficients (ascending, length k+1) of prod_j (X - x_j) for each row of x (shape (..., k))."""
    k = x.shape[-1]
    width = 1 << max(0, (k - 1).bit_length())
    polys = np.zeros((*x.shape[:-1], width, 2), dtype=np.int64)
    polys[..., :k, 0] = (-x) % PRIME
    polys[..., :k, 1] = 1
    polys[..., k:, 0] = 1  # padding factors equal to the constant 1
    while polys.shape[-2] > 1:
        polys = _poly_mul_pairs(polys)
    return polys[..., 0, : k + 1]


def interpolate(x: Int64Array, y: Int64Array) -> Int64Array:
    """Coefficients (ascending, length k) of the polynomial through (x_i, y_i) over GF(p).

    x: (..., k) distinct residues in [0, p); y: (..., k) integers (reduced mod p here).
    """
    k = x.shape[-1]
    x = x % PRIME
    m = master_polynomial(x)  # (..., k+1), m_k = 1
    powers = power_matrix(x, k).astype(np.float64)  # (..., k, k)
    derivative = (m[..., 1:] * np.arange(1, k + 1, dtype=np.int64)) % PRIME  # M'(X) coefficients
    m_prime_at_x = _exact_matmul(powers, derivative[..., :, None].astype(np.float64))[..., 0]
    if np.any(m_prime_at_x == 0):
        raise ProofError("interpolation points are not distinct (mod 65497)")
    weights = inverse_table()[m_prime_at_x]
    u = (y % PRIME) * weights % PRIME
    g = _exact_matmul(u[..., None, :].astype(np.float64), powers)[..., 0, :].astype(np.float64)  # (..., k)
    # Hankel matrix H[s, j] = m_{s+j+1} (zero past degree k) as a strided view.
    m_ext = np.zeros((*m.shape[:-1], 2 * k), dtype=np.float64)
    m_ext[..., :k] = m[..., 1:]
    hankel = np.lib.stride_tricks.sliding_window_view(m_ext, k, axis=-1)[..., :k, :]
    return _exact_matmul(g[..., None, :], hankel)[..., 0, :]


def evaluate(coeffs: Int64Array, x: Int64Array) -> Int64Array:
    """Evaluate polynomials (ascending coefficients (..., n)) at points x (..., k), mod p."""
    n = coeffs.shape[-1]
    powers = power_matrix(x % PRIME, n).astype(np.float64)  # (..., k, n)
    return _exact_matmul(powers, coeffs[..., :, None].astype(np.float64))[..., 0]


def injective_modulus(x: Int64Array, start: int = PRIME) -> NDArray[np.int64]:
    """Per row, the largest m <= start with x % m pairwise distinct (the reference's search order).

    Rows where even m = k fails cannot happen for distinct indices; every row resolves at some m >= k.
    """
    rows = x.reshape(-1, x.shape[-1])
    result = np.zeros(rows.shape[0], dtype=np.int64)
    pending = np.arange(rows.shape[0])
    m = start
    while pending.size:
        if m < 1:
            raise ProofError("no injective modulus: indices are not distinct")
        residues = np.sort(rows[pending] % m, axis=-1)
        ok = np.all(np.diff(residues, axis=-1) != 0, axis=-1)
        result[pending[ok]] = m
        pending = pending[~ok]
        m -= 1
    return result.reshape(x.shape[:-1])
