"""Seeded Gumbel-max sampling that a verifier can replay exactly, on any machine and any device.

The protocol gives every sequence a 64-bit ``seed`` (derived from node, policy version and task).
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
4. Gumbel: ``g = -log(-log(u))`` in float32.

Steps 1-3 are bit-identical everywhere (integer arithmetic; no ``torch.Generator``, whose CPU and
CUDA streams differ). Step 4 goes through the device's float32 ``log``, which may differ by one
ulp between libms; together with the float differences in the logits themselves this is why a
verifier compares *margins* (``scores``) against a tolerance instead of demanding equality.

``sample`` returns the chosen tokens and their *sampling* logprobs:
``log_softmax(processed)[token]``, the log-probability under the distribution actually sampled
from (after temperature and top-k/top-p). With ``temperature == 0`` sampling is greedy
(``argmax(logits)``, no noise) and the logprob is taken under the plain ``T = 1`` distribution
``log_softmax(logits)`` (top-k/top-p ignored: the argmax is inside any such set anyway).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

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


def uniform_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 32-bit hash per (row, token) as int32 [B, V] (bit pattern; see module docstring)."""
    if seeds.shape != steps.shape or seeds.dim() != 1:
        raise ValueError(f"seeds and steps must be 1-D of equal length, got {seeds.shape} / {steps.shape}")
    keys = [row_keys(int(s), int(t)) for s, t in zip(seeds.tolist(), steps.tolist(), strict=True)]
    device = seeds.device
    k1 = torch.tensor(_to_i32([k[0] for k in keys]), dtype=torch.int32, device=device)
    k2 = torch.tensor(_to_i32([k[1] for k in keys]), dtype=torch.int32, device=device)
    x = _token_mix(vocab_size, device).unsqueeze(0) + k1.unsqueeze(1)  # int32 add wraps mod 2**32
    x ^= _lsr(x, 16)
    x *= _C_MUL1
    x ^= k2.unsqueeze(1)
    x ^= _lsr(x, 15)
    x *= _C_MUL2
    x ^= _lsr(x, 16)
    return x


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float32 [B, V], bit-identical on every device."""
    x = uniform_bits(seeds, steps, vocab_size)
    return (_lsr(x, 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [B, V], a pure function of (seed, step, token id)."""
    u = uniforms(seeds, steps, vocab_size)
    return u.log_().neg_().log_().neg_()


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
        noise = gumbel_noise(seeds.to(processed.device), steps.to(processed.device), processed.shape[-1])
        tokens = (processed + noise).argmax(dim=-1)
    chosen = processed.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logprobs = chosen - torch.logsumexp(processed, dim=-1)
    return tokens, logprobs
