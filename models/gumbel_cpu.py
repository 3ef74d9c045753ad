"""The sampler's search for the tokens that can still win, compiled for a CPU (numba): one pass per row.

``sampling._pruned_argmax`` finds, per row, the few tokens whose Gumbel value could lift them to the top with
about twenty elementwise torch passes over the logits (the integer hash of every token, then an exp and a
compare). This module does the same search in a few compiled loops per row that LLVM vectorises, and returns
the candidates; ``sampling`` then scores them exactly (``gumbel_at``'s float64 logs, in torch) and takes the
best, so the tokens are the full scores' argmax on either path. Only the test that rules a token out differs,
and both tests err only towards keeping a token:

1. The row's argmax ``t`` (the maximum from ``torch.amax``, then its first index, as ``torch.argmax``) and its
   exact score ``S = logit[t] + g(t)``: a lower bound on the row's best score.
2. A token ``v`` can win only if ``logit[v] + g(v) >= S``. With ``k`` the top 23 bits of ``v``'s hash and
   ``w = (2**23 - 1 - k + 0.5) / 2**23``, ``-log(u) >= w`` gives ``g(v) <= -log(w)``, so ``v`` can win only if
   ``log2(w) <= (logit[v] - S) / log(2)``. The left side is bounded below without a logarithm: a positive
   float's bits, read as an integer, are ``2**23 * (exponent + 127) + mantissa``, and ``log2(1 + f) >= f``, so
   ``bits(2**23 w) / 2**23 - 150 <= log2(w)`` (off by at most 0.09). ``v`` is kept when that bound passes the
   test against ``S`` lowered by the torch path's float-rounding margin and 0.01-nat slack (which also cover
   the bound's own float32 rounding, a few 1e-6). A few more tokens are kept than by the torch path's exact
   test; none that can win is dropped.

A row whose maximum or top score is not finite (NaN, +inf, all -inf) is not searched here: ``candidates``
returns None and ``sampling`` takes its torch path, which keeps ``torch.argmax``'s rules for those rows.

It runs on the calling thread: ~15 us a 49152-token row here, against the ~1.5 ms a token of a SmolLM2 decode
step; handing rows to other threads lost more than it won inside vLLM, whose OpenMP threads spin on the cores
between its kernels.

numba is optional: where importing this module fails, ``sampling`` runs the torch path, as it does for logits on
an accelerator, for batches under ``sampling.COMPILED_MIN_LOGITS`` logits or with ``PRIME_SAMPLER=torch``; the
tokens are the same. The loops compile once per machine
(``cache=True``: a few seconds the first time, then a fraction of a second to load from numba's cache).
"""
from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import torch
from numba import njit

# sampling's constants, copied: sampling imports this module, and a package has no import cycles
# (test_sampling.py holds the copies equal to sampling's)
_GOLD, _MUL1, _MUL2 = 0x9E3779B9, 0x7FEB352D, 0x846CA68B
_EPS32 = float(np.finfo(np.float32).eps)
_GUMBEL_BOUND = 17.0
_LOG_2_23 = 23 * math.log(2)
_REACH_SLACK = 0.01

numba_version = str(numba.__version__)

_INV_2_23 = 1.0 / (1 << 23)
_INV_LN2 = 1.0 / math.log(2)
_M32 = np.uint64(0xFFFFFFFF)
_S9, _S15, _S16 = np.uint64(9), np.uint64(15), np.uint64(16)


@njit(nogil=True, cache=True, inline="always")
def _hash32(v: int, k1: Any, k2: Any) -> Any:
    """``sampling._avalanche`` on one token, in uint64 arithmetic kept to 32 bits."""
    x = (np.uint64(v) * np.uint64(_GOLD) + k1) & _M32
    x ^= x >> _S16
    x = (x * np.uint64(_MUL1)) & _M32
    x ^= k2
    x ^= x >> _S15
    x = (x * np.uint64(_MUL2)) & _M32
    x ^= x >> _S16
    return x


@njit(nogil=True, cache=True)
def _search(logits: Any, tops: Any, k1s: Any, k2s: Any, out: Any, counts: Any) -> None:
    """Every row (``tops``: their maxima): their candidates into out[b, :counts[b]]; -1 where not finite.

    Each loop but the last is vectorised by LLVM (no gather, no call, no branch in it)."""
    v_n = logits.shape[1]
    w = np.empty(v_n, dtype=np.float32)  # 2**23 w = m + 0.5, exact in float32
    w_bits = w.view(np.int32)
    keep = np.zeros((v_n + 7) // 8 * 8, dtype=np.uint8)  # padded to whole words, the padding stays 0
    keep_words = keep.view(np.uint64)
    for b in range(logits.shape[0]):
        row, best = logits[b], tops[b]
        if not (abs(best) < np.inf):  # NaN (torch.amax propagates it), +inf, all -inf: the torch path
            counts[b] = -1
            continue
        top = v_n
        for v in range(v_n):  # the first index of the maximum, as torch.argmax (a min-reduction)
            top = min(top, v if row[v] == best else v_n)
        k1, k2 = np.uint64(k1s[b]), np.uint64(k2s[b])
        u = (np.float64(_hash32(top, k1, k2) >> _S9) + 0.5) / 8388608.0
        score = np.float32(best + np.float32(-math.log(-math.log(u))))  # as sampling._top_scores
        margin = np.float32(1e-3 + 16 * _EPS32 * (abs(score) + _GUMBEL_BOUND + _LOG_2_23 + 1))
        floor = np.float32(score - margin - np.float32(_REACH_SLACK))
        if not (abs(floor) < np.inf):
            counts[b] = -1
            continue
        for v in range(v_n):
            w[v] = np.float32(np.int64(0x7FFFFF) - np.int64(_hash32(v, k1, k2) >> _S9)) + np.float32(0.5)
        # log2(2**23 w) >= bits(2**23 w) / 2**23 - 127 (a float's bits, read as an integer, are its exponent plus
        # 127 and then its mantissa; log2(1 + f) >= f); keep v iff log2(w) <= (logit - floor) / log(2)
        for v in range(v_n):
            keep[v] = np.float32(w_bits[v]) * np.float32(_INV_2_23) - np.float32(150.0) \
                <= (row[v] - floor) * np.float32(_INV_LN2)
        n = 0
        for i in range(keep_words.shape[0]):  # eight tokens at a time: almost every word is 0
            if keep_words[i] != 0:
                for v in range(i * 8, i * 8 + 8):
                    if keep[v]:
                        out[b, n] = v
                        n += 1
        counts[b] = n


@njit(nogil=True, cache=True)
def _flatten(out: Any, counts: Any) -> tuple[Any, Any]:
    """The rows' candidates as flat (rows, tokens) int64 arrays."""
    total = 0
    for b in range(counts.shape[0]):
        total += counts[b]
    rows = np.empty(total, dtype=np.int64)
    toks = np.empty(total, dtype=np.int64)
    i = 0
    for b in range(counts.shape[0]):
        for n in range(counts[b]):
            rows[i] = b
            toks[i] = out[b, n]
            i += 1
    return rows, toks


def candidates(processed: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens) of every token that can still win its row (a superset of the winners; see the module
    docstring), for float32 logits [B, V] on a CPU and the rows' int32 keys; None if a row is not finite.
    Runs on the calling thread (see the module docstring)."""
    logits = processed.detach().contiguous().numpy()
    tops = processed.detach().amax(-1).numpy()  # torch's vectorised max, a fraction of a scalar loop's time
    b, v = logits.shape
    k1s, k2s = k1.numpy().view(np.uint32), k2.numpy().view(np.uint32)
    out = np.empty((b, v), dtype=np.int32)  # pages are touched only as far as each row's candidates go
    counts = np.empty(b, dtype=np.int64)
    _search(logits, tops, k1s, k2s, out, counts)
    if bool((counts < 0).any()):
        return None
    rows, toks = _flatten(out, counts)
    return torch.from_numpy(rows), torch.from_numpy(toks)
