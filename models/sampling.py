"""Seeded Gumbel-max sampling that a verifier can replay exactly, on any machine and any device.

The protocol gives every sequence a 64-bit ``seed`` (derived from node, policy version and task;
passed as int64 tensors, ``seed_tensor`` turns unsigned 64-bit seeds into the same bits).
The token generated at ``step`` (0 for the first generated token, 1 for the next, ...) is

    token = argmax_v( processed[v] + gumbel(seed, step, v) )

where ``processed = process_logits(logits, params)`` (logits / temperature, tokens outside top-k /
top-p set to -inf) and the Gumbel noise is a pure function of ``(seed, step, v)``:

1. Row key: ``k1, k2`` = the low and high 32 bits of ``splitmix64(splitmix64(seed) ^ step)``,
   computed with exact Python integers (seed and step taken modulo 2**64).
2. Per token: ``x = (k1 + v * 0x9E3779B9) mod 2**32``, then a 32-bit avalanche
   (``x ^= x >> 16; x *= 0x7FEB352D; x ^= k2; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``,
   all mod 2**32, logical shifts), done with int32 torch ops whose wrap-around is exact on
   every backend. For a fixed row this is a bijection of ``v``: no two tokens share a value.
3. Uniform: ``u = ((x >> 9) + 0.5) / 2**23`` -- exactly representable in float32 and strictly
   inside (0, 1).
4. Gumbel: ``g = -log(-log(u))`` computed in float64 and rounded to float32.

Steps 1-3 are bit-identical everywhere (integer arithmetic; no ``torch.Generator``, whose CPU and
CUDA streams differ). Step 4 goes through the device's ``log``; libms may differ by an ulp in
float64, which after rounding to float32 almost never changes a value. The logits themselves do
differ slightly between devices and batch shapes, which is why a verifier compares *margins*
(``scores``) against a tolerance instead of demanding equality.

``sample`` takes the Gumbel value's logarithms only for tokens that can still win, which gives the
same token as ``scores(...).argmax(-1)`` at a fraction of the cost: with top-k/top-p, tokens within
``GUMBEL_BOUND`` of a known score (the Gumbel values are bounded above because u <= 1 - 2**-24);
without, every token's integer hash and one bound from it (``_pruned_argmax``: ``g <= -log(1 - u)``)
rule out all but a few dozen tokens of an LM's row. On a CPU with numba installed that search runs
compiled for batches of at least ``COMPILED_MIN_LOGITS`` logits (``models/gumbel_cpu.py``, several times
faster; ``PRIME_SAMPLER=compiled|torch`` forces one path). Tests hold every path to the full scores' argmax,
ties and one-ulp margins included.

``sample`` returns the chosen tokens and their *sampling* logprobs:
``log_softmax(processed)[token]``, the log-probability under the distribution actually sampled
from (after temperature and top-k/top-p). With ``temperature == 0`` sampling is greedy
(``argmax(logits)``, no noise) and the logprob is taken under the plain ``T = 1`` distribution
``log_softmax(logits)`` (top-k/top-p ignored: the argmax is inside any such set anyway).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from types import ModuleType

import torch
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


class SamplingParams(BaseModel):
    """How logits become a token. Shared by node (to sample) and validator (to replay)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    """Logits are divided by this; 0 means greedy (argmax, no noise)."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens (ties at the k-th value are all kept); 0 disables it."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 disables it."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def seed_tensor(seeds: list[int]) -> torch.Tensor:
    """Seeds (signed or unsigned 64-bit integers) as an int64 tensor holding the same 64 bits."""
    return torch.tensor([s - (1 << 64) if s >= (1 << 63) else s for s in seeds], dtype=torch.long)


def splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (exact, on Python integers)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys (k1, k2) of one (seed, step) row; see the module docstring."""
    h = splitmix64(splitmix64(seed & _M64) ^ (step & _M64))
    return h & _M32, h >> 32


def _to_i32(values: list[int]) -> list[int]:
    """Unsigned 32-bit values as signed int32 (the same bits)."""
    return [v - (1 << 32) if v >= (1 << 31) else v for v in values]


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> is arithmetic: mask away the sign copies)."""
    return (x >> k) & ((1 << (32 - k)) - 1)


_C_GOLD = 0x9E3779B9 - (1 << 32)  # as int32
_C_MUL1 = 0x7FEB352D
_C_MUL2 = 0x846CA68B - (1 << 32)
_token_mix_cache: dict[tuple[int, str], torch.Tensor] = {}


def _token_mix(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``v * 0x9E3779B9 mod 2**32`` for every token id, as int32 [V] (cached per vocab and device)."""
    key = (vocab_size, str(device))
    t = _token_mix_cache.get(key)
    if t is None:
        ids = torch.arange(vocab_size, dtype=torch.int64)
        mixed = (ids * 0x9E3779B9) & _M32
        mixed = torch.where(mixed >= (1 << 31), mixed - (1 << 32), mixed)
        t = mixed.to(torch.int32).to(device)
        _token_mix_cache[key] = t
    return t


def _keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row keys k1, k2 as int32 [B] on the seeds' device."""
    if seeds.shape != steps.shape or seeds.dim() != 1:
        raise ValueError(f"seeds and steps must be 1-D of equal length, got {seeds.shape} / {steps.shape}")
    keys = [row_keys(int(s), int(t)) for s, t in zip(seeds.tolist(), steps.tolist(), strict=True)]
    device = seeds.device
    k1 = torch.tensor(_to_i32([k[0] for k in keys]), dtype=torch.int32, device=device)
    k2 = torch.tensor(_to_i32([k[1] for k in keys]), dtype=torch.int32, device=device)
    return k1, k2


def _avalanche(mixed: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """The per-token hash from ``v * 0x9E3779B9`` (int32) and broadcastable row keys."""
    x = mixed + k1  # int32 add wraps mod 2**32
    x ^= _lsr(x, 16)
    x *= _C_MUL1
    x ^= k2
    x ^= _lsr(x, 15)
    x *= _C_MUL2
    x ^= _lsr(x, 16)
    return x


def _bits_to_gumbel(x: torch.Tensor) -> torch.Tensor:
    # u = ((x >> 9) + 0.5) / 2**23 exactly; the logs run in float64 and round once to float32, so
    # a one-ulp difference between libms (or vectorised and scalar loops) almost never shows.
    # (_dense_gumbel_chunks does the same arithmetic in place, chunk by chunk.)
    u = _lsr(x, 9).to(torch.float64).mul_(1.0 / (1 << 23)).add_(1.0 / (1 << 24))
    return u.log_().neg_().log_().neg_().to(torch.float32)


def uniform_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 32-bit hash per (row, token) as int32 [B, V] (bit pattern; see module docstring)."""
    k1, k2 = _keys(seeds, steps)
    return _avalanche(_token_mix(vocab_size, seeds.device).unsqueeze(0), k1.unsqueeze(1), k2.unsqueeze(1))


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float32 [B, V], bit-identical on every device."""
    x = uniform_bits(seeds, steps, vocab_size)
    return (_lsr(x, 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


# Rows per chunk of the dense noise loop: a few rows of a 50k vocabulary stay in the CPU cache and
# reuse their buffers, which makes the ~20 elementwise passes ~3x faster than whole-batch tensors.
_CHUNK_ELEMENTS = 1 << 17


def _chunk_rows(b: int, vocab_size: int, device: torch.device) -> int:
    """Rows per pass of the noise loops: cache-sized on a CPU; all of them on an accelerator, where each pass is
    a kernel launch and there is no CPU cache to stay in."""
    if device.type != "cpu":
        return max(1, b)
    return max(1, min(b, _CHUNK_ELEMENTS // max(1, vocab_size)))


def _hash_chunks(
    seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int, keys: tuple[torch.Tensor, torch.Tensor] | None = None
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Yield (r0, r1, hash, k) of rows r0:r1: the 32-bit hash as int32 (``uniform_bits``) and its top 23 bits
    ``k = hash >> 9`` (logical), in buffers reused from one chunk to the next (``keys``: the rows' ``_keys``,
    when the caller has them already)."""
    k1, k2 = keys if keys is not None else _keys(seeds, steps)
    mix = _token_mix(vocab_size, seeds.device)
    b = seeds.shape[0]
    rows = _chunk_rows(b, vocab_size, seeds.device)
    x = torch.empty((rows, vocab_size), dtype=torch.int32, device=seeds.device)
    t = torch.empty_like(x)
    for r0 in range(0, b, rows):
        r1 = min(b, r0 + rows)
        xs, ts = x[: r1 - r0], t[: r1 - r0]
        torch.add(mix, k1[r0:r1, None], out=xs)  # the same steps as _avalanche, in place
        torch.bitwise_right_shift(xs, 16, out=ts).bitwise_and_(0xFFFF)
        xs ^= ts
        xs *= _C_MUL1
        xs ^= k2[r0:r1, None]
        torch.bitwise_right_shift(xs, 15, out=ts).bitwise_and_(0x1FFFF)
        xs ^= ts
        xs *= _C_MUL2
        torch.bitwise_right_shift(xs, 16, out=ts).bitwise_and_(0xFFFF)
        xs ^= ts
        torch.bitwise_right_shift(xs, 9, out=ts).bitwise_and_(0x7FFFFF)
        yield r0, r1, xs, ts


def _dense_gumbel_chunks(
    seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (r0, r1, float32 Gumbel noise of rows r0:r1), the same values as ``gumbel_noise``."""
    rows = _chunk_rows(seeds.shape[0], vocab_size, seeds.device)
    f = torch.empty((rows, vocab_size), dtype=torch.float64, device=seeds.device)
    for r0, r1, _, ks in _hash_chunks(seeds, steps, vocab_size):
        fs = f[: r1 - r0]
        fs.copy_(ks).mul_(1.0 / (1 << 23)).add_(1.0 / (1 << 24))
        yield r0, r1, fs.log_().neg_().log_().neg_().to(torch.float32)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [B, V], a pure function of (seed, step, token id)."""
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    for r0, r1, g in _dense_gumbel_chunks(seeds, steps, vocab_size):
        out[r0:r1] = g
    return out


def gumbel_at(
    seeds: torch.Tensor, steps: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """The same noise as ``gumbel_noise(...)[rows, tokens]``, computed only at those entries."""
    return _gumbel_keyed(_keys(seeds, steps), rows, tokens, vocab_size)


def _gumbel_keyed(
    keys: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, tokens: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``gumbel_at`` from the rows' ``_keys`` (computed once per sampling call, not once per use)."""
    k1, k2 = keys
    mixed = _token_mix(vocab_size, k1.device)[tokens]
    return _bits_to_gumbel(_avalanche(mixed, k1[rows], k2[rows]))


def _top_scores(processed: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Each row's exact score (logit + Gumbel value) at its top logit: a lower bound on the row's best score."""
    arange = torch.arange(processed.shape[0], device=processed.device)
    top = processed.argmax(-1)
    return processed[arange, top] + _gumbel_keyed(keys, arange, top, processed.shape[1])


# Largest Gumbel value the sampler can produce: u <= 1 - 2**-24 gives g <= 16.64; the margin
# also covers float32 rounding of ``logit + g`` for any sane logit magnitude.
GUMBEL_BOUND = 17.0


def _dense_argmax(processed: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    tokens = torch.empty(processed.shape[0], dtype=torch.long, device=processed.device)
    for r0, r1, g in _dense_gumbel_chunks(seeds, steps, processed.shape[1]):
        tokens[r0:r1] = (processed[r0:r1] + g).argmax(-1)
    return tokens


_REACH_SLACK = 0.01
"""Nats by which the pruned sampler's test errs on the side of keeping a token: far above any float rounding of
the test or of g itself (about 1e-6), so a libm's last bits never decide what is pruned."""
_LOG_2_23 = 23 * math.log(2)


def _first_best(rows: torch.Tensor, toks: torch.Tensor, sc: torch.Tensor, b: int, v: int) -> torch.Tensor:
    """Per row, the lowest token id among the highest scores ``sc`` of its entries (``torch.argmax``'s rule)."""
    best = torch.full((b,), float("-inf"), device=sc.device).scatter_reduce(0, rows, sc, "amax")
    winners = sc == best[rows]
    first = torch.full((b,), v, dtype=torch.long, device=sc.device)
    return first.scatter_reduce(0, rows[winners], toks[winners], "amin")


_compiled: ModuleType | None = None
_compiled_missing = False

COMPILED_MIN_LOGITS = 1 << 15
"""Under ``PRIME_SAMPLER=auto`` (the default) a call with fewer logits than this (less than one row of SmolLM2's
49152-token vocabulary; a tiny model's 512-logit rows up to a batch of 63) runs the torch search: loading numba
and its kernels costs a process ~0.5 s once, which such rows never win back (the test suite starts dozens of
tiny-model nodes)."""
SEARCHES = ("auto", "compiled", "torch")


def _compiled_search(logits: int) -> ModuleType | None:
    """``models.gumbel_cpu`` for a call on ``logits`` CPU logits, or None for the torch path (the same tokens).

    ``PRIME_SAMPLER``: ``auto`` (default) the compiled search where numba is installed and the call has at least
    ``COMPILED_MIN_LOGITS`` logits; ``compiled`` it wherever numba is installed; ``torch`` never."""
    global _compiled, _compiled_missing
    mode = os.environ.get("PRIME_SAMPLER", "") or "auto"
    if mode not in SEARCHES:
        raise ValueError(f"PRIME_SAMPLER={mode!r}: expected one of {', '.join(SEARCHES)}")
    if _compiled_missing or mode == "torch" or (mode == "auto" and logits < COMPILED_MIN_LOGITS):
        return None
    if _compiled is None:
        try:
            from models import gumbel_cpu
        except ImportError:  # numba is not installed (a GPU host's bundle): the torch path, quietly
            _compiled_missing = True
            return None
        except Exception as e:  # numba installed but unusable here (e.g. no writable cache directory)
            _compiled_missing = True
            logger.warning("sampling: the compiled CPU search is unavailable (%s: %s); the torch path samples the "
                           "same tokens, slower", type(e).__name__, e)
            return None
        _compiled = gumbel_cpu
    return _compiled


def search_path() -> str:
    """Which search ``sample`` runs here on a batch of CPU logits at least ``COMPILED_MIN_LOGITS`` large:
    ``compiled (numba X)`` or ``torch``. Loads (or compiles) the compiled one and runs it once, so the first real
    step does not pay for that."""
    compiled = _compiled_search(COMPILED_MIN_LOGITS)
    if compiled is None:
        return "torch"
    found = compiled.candidates(torch.zeros((1, 8)), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    if found is None or found[0].numel() == 0:
        raise RuntimeError("sampling: the compiled search kept no token of a finite row")
    return f"compiled (numba {compiled.numba_version})"


def _pruned_argmax(processed: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The same tokens as ``_dense_argmax``, with the logarithms taken only where a token can still win.

    Every token's 32-bit hash is computed (integer passes, cheap), but not its Gumbel value. The top logit's
    exact score ``S`` is a lower bound on the row's best. With ``u = (k + 0.5) / 2**23`` (``k`` the hash's
    top 23 bits) and ``w = 1 - u``, ``-log(u) >= w``, so ``g = -log(-log(u)) <= -log(w)``: a token with
    ``w > exp(logit - S)`` (less a margin for float rounding and a 0.01 nat slack) has ``logit + g < S`` and
    cannot win. The test is one exp and a compare per token, no table and no log. The tokens left (a few
    dozen a row for an LM at temperature 1) get their exact scores (``gumbel_at``'s float64 logs) and the
    best wins, ties to the lowest id as in ``torch.argmax``. A row whose top logit or its score is not finite
    goes the dense way (NaN and infinity keep ``torch.argmax``'s own rules there). On a CPU the search for the
    live tokens runs compiled where ``_compiled_search`` allows (``models/gumbel_cpu.py``: a looser test, the
    same exact scoring).
    """
    b, v = processed.shape
    device = processed.device
    seeds, steps = seeds.to(device), steps.to(device)
    keys = _keys(seeds, steps)
    compiled = _compiled_search(b * v) if device.type == "cpu" else None
    found = compiled.candidates(processed, *keys) if compiled is not None else None
    if found is not None:  # the same search compiled (models/gumbel_cpu.py): a few vectorised loops a row
        rows, toks = found
        return _first_best(rows, toks, processed[rows, toks] + _gumbel_keyed(keys, rows, toks, v), b, v)
    floor = _top_scores(processed, keys)
    if not bool(torch.isfinite(floor).all()):
        return _dense_argmax(processed, seeds, steps)
    # live iff m + 0.5 <= exp(logit - A) for m = 2**23 - 1 - k (w = (m + 0.5) / 2**23), A = S - margin - slack -
    # 23 log 2; tested as m < exp(logit - A), which keeps a few more
    margin = 1e-3 + 16 * torch.finfo(torch.float32).eps * (floor.abs() + GUMBEL_BOUND + _LOG_2_23 + 1)
    shift = (floor - margin - _REACH_SLACK - _LOG_2_23).unsqueeze(1)
    chunk_rows = _chunk_rows(b, v, device)
    bound = torch.empty((chunk_rows, v), dtype=torch.float32, device=device)
    live = torch.empty((b, v), dtype=torch.bool, device=device)
    for r0, r1, _, ks in _hash_chunks(seeds, steps, v, keys):
        bs = bound[: r1 - r0]
        torch.sub(processed[r0:r1], shift[r0:r1], out=bs).exp_()  # a -inf logit: 0, never live
        ks ^= 0x7FFFFF  # m = 2**23 - 1 - k
        torch.lt(ks, bs, out=live[r0:r1])
    rows, toks = live.nonzero(as_tuple=True)
    return _first_best(rows, toks, processed[rows, toks] + _gumbel_keyed(keys, rows, toks, v), b, v)


def _gumbel_argmax(processed: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``argmax(processed + gumbel_noise)`` per row, computing noise only where a token can win.

    (Or, when too many tokens can, densely in cache-sized row chunks.)

    Any token's score is a lower bound on the row's best score; a token whose logit is more than
    GUMBEL_BOUND below that bound can never reach it, so its noise is not needed. Ties resolve to
    the lowest token id, as ``torch.argmax`` does on the full scores.
    """
    b, v = processed.shape
    device = processed.device
    seeds, steps = seeds.to(device), steps.to(device)
    keys = _keys(seeds, steps)
    floor = _top_scores(processed, keys) - GUMBEL_BOUND
    candidates = processed >= floor.unsqueeze(1)
    if int(candidates.sum()) * 16 > b * v:
        return _dense_argmax(processed, seeds, steps)
    rows, toks = candidates.nonzero(as_tuple=True)
    sc = processed[rows, toks] + _gumbel_keyed(keys, rows, toks, v)
    return _first_best(rows, toks, sc, b, v)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p masking (to -inf); float32 [B, V] in, float32 out.

    With temperature 0 the logits are returned unscaled and unmasked (greedy uses them as is).
    """
    x = logits.float()
    if params.greedy:
        return x
    if params.temperature != 1.0:
        x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # the most likely token always has before == 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def scores(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """``processed + gumbel`` [B, V]: the token sampled is its argmax (for greedy: the logits).

    A verifier reads the margin by which a submitted token lost from these scores.
    """
    processed = process_logits(logits, params)
    if params.greedy:
        return processed
    noise = gumbel_noise(seeds.to(processed.device), steps.to(processed.device), processed.shape[-1])
    return processed + noise


def sample(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: (tokens int64 [B], sampling logprobs float32 [B])."""
    processed = process_logits(logits, params)
    if params.greedy:
        tokens = processed.argmax(dim=-1)
    else:
        seeds, steps = seeds.to(processed.device), steps.to(processed.device)
        if params.top_k or params.top_p < 1.0:  # few finite logits: noise only where one can win
            tokens = _gumbel_argmax(processed, seeds, steps)
        else:  # at T ~ 1 an LM keeps ~20% of its vocabulary within GUMBEL_BOUND: hash all, log a few
            tokens = _pruned_argmax(processed, seeds, steps)
    # torch's fused log_softmax kernel: half the time of gather - logsumexp on this CPU (one pass of exps)
    logprobs = torch.log_softmax(processed, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
