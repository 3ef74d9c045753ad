"""Sampling check: replay the seeded Gumbel-max draw of every submitted token.

A node samples token t of a sequence as `argmax(process_logits(logits_t) + gumbel(seed, t))`
(`models.sampling`), with a seed the protocol derives (`protocol.seeds.sampling_seed`), never one
the node picks. The validator recomputes the logits with one prefill and replays the draw; for
each position it measures the *margin* by which the submitted token lost to the replayed winner
(0 when it won). Positions whose margin exceeds the tolerance are reported. Float differences
between the node's decode and the validator's prefill move scores by far less than the tolerance;
a token chosen any other way (another model, a hand edit, a cherry-picked sample) loses by a lot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.errors import ProtocolError

if TYPE_CHECKING:
    import torch

    from models.sampling import SamplingParams

_ROWS_PER_BLOCK = 256  # bounds the [rows, vocab] float32 score buffer (256 x 50k = 50 MB)
_DENSE_ELEMENTS = 1 << 19  # noise + scores of a few rows at a time stay in cache


@dataclass(frozen=True)
class SamplingCheck:
    """Per-sequence replay measurements."""

    margins: tuple[float, ...]
    """Per generated position: winner's score minus the submitted token's (0 if it won; inf when the
    token was outside the top-k/top-p set)."""
    winners: tuple[int, ...]
    """Per position: the token the replayed draw picks."""
    mismatch_positions: tuple[int, ...]
    """Positions whose margin exceeds `tolerance`."""
    tolerance: float
    """The tolerance these positions were measured with."""
    near_ties: tuple[int, ...] = ()
    """Near-tie disagreements: positions where the replay picks another token than the submitted one, but by
    no more than `tolerance` (not mismatches). Honest float drift flips such a near-tie rarely and whatever
    the tokens; a node choosing among near-ties on purpose does it every time it gains."""

    @property
    def max_margin(self) -> float:
        return max(self.margins, default=0.0)


def _as_token_list(tokens: torch.Tensor | Sequence[int], vocab: int) -> list[int]:
    import torch

    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise ProtocolError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        values = [int(t) for t in tokens.tolist()]
    else:
        if any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise ProtocolError("tokens must be integers")
        values = list(tokens)
    bad = [t for t in values if not 0 <= t < vocab]
    if bad:
        raise ProtocolError(f"token id {bad[0]} outside the vocabulary [0, {vocab})")
    return values


def check_sampling(
    logits: torch.Tensor,
    tokens: torch.Tensor | Sequence[int],
    params: SamplingParams,
    seed: int,
    *,
    tolerance: float,
    first_step: int = 0,
) -> SamplingCheck:
    """Replay the draws of `tokens` (T,) from the validator's `logits` (T, V).

    Row t of `logits` is the distribution the t-th generated token was drawn from (the prefill
    output at the position before it); its sampler step is `first_step + t`. (`replay_draws` does
    the same for rows of many sequences at once.)
    """
    import torch

    from models.sampling import process_logits

    if logits.dim() != 2:
        raise ProtocolError(f"logits must be (T, V), got shape {tuple(logits.shape)}")
    seq, vocab = logits.shape
    ids = _as_token_list(tokens, vocab)
    if len(ids) != seq:
        raise ProtocolError(f"{len(ids)} tokens for {seq} logit rows")
    check_seed(seed)
    device = logits.device
    token_tensor = torch.tensor(ids, dtype=torch.int64, device=device)
    steps = torch.arange(first_step, first_step + seq, dtype=torch.int64, device=device)
    seeds = torch.full((seq,), seed, dtype=torch.int64, device=device)
    margins: list[float] = []
    winners: list[int] = []
    for start in range(0, seq, _ROWS_PER_BLOCK):
        end = min(seq, start + _ROWS_PER_BLOCK)
        processed = process_logits(logits[start:end], params)
        margin, arg = replay_draws(processed, token_tensor[start:end], params, seeds[start:end], steps[start:end])
        margins.extend(float(m) for m in margin.tolist())
        winners.extend(int(w) for w in arg.tolist())
    return sampling_check(margins, winners, ids, tolerance)


def check_seed(seed: int) -> None:
    """Raise `ProtocolError` unless `seed` is a protocol sampling seed (in [0, 2**63))."""
    if not 0 <= seed < 2**63:
        raise ProtocolError(f"seed must be in [0, 2**63), got {seed}")


def sampling_check(margins: Sequence[float], winners: Sequence[int], tokens: Sequence[int],
                   tolerance: float) -> SamplingCheck:
    """The `SamplingCheck` of one sequence from its replayed margins and winners (see `replay_draws`)."""
    bad = tuple(i for i, m in enumerate(margins) if m > tolerance)
    near = tuple(i for i, (m, w) in enumerate(zip(margins, winners, strict=True))
                 if w != tokens[i] and m <= tolerance)
    return SamplingCheck(tuple(margins), tuple(winners), bad, tolerance, near)


def replay_draws(
    processed: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(margin float64, winner) per row: row r is the draw of `tokens[r]` from `processed[r]`
    (`models.sampling.process_logits` of its logits) with `seeds[r]` at sampler step `steps[r]`. The
    rows may come from any number of sequences: every row is replayed on its own."""
    import torch

    best, arg, chosen = _replay_block(processed, tokens, params, seeds, steps)
    margin = best.double() - chosen.double()
    margin = torch.where(torch.isfinite(chosen), margin, torch.full_like(margin, math.inf))
    return margin, arg


def _replay_block(
    processed: torch.Tensor, tokens: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(winner's score, winner, submitted token's score) per row of `processed + gumbel`.

    The noise is computed only where a token can still beat both the submitted token and the
    most likely one (Gumbel values are bounded by `GUMBEL_BOUND`), exactly as `models.sampling`
    samples; when too many tokens are in reach the dense scores are cheaper.
    """
    import torch

    from models.sampling import GUMBEL_BOUND, gumbel_at, gumbel_noise

    b, v = processed.shape
    rows = torch.arange(b, device=processed.device)
    if params.greedy:
        best, arg = processed.max(dim=-1)
        return best, arg, processed[rows, tokens]
    chosen = processed[rows, tokens] + gumbel_at(seeds, steps, rows, tokens, v)
    if not (params.top_k or params.top_p < 1.0):
        # Plain temperature sampling keeps a large share of an LM's vocabulary within reach of the
        # winner (~half of SmolLM2's at T=1): go dense, in cache-sized row slices.
        best = torch.empty(b, dtype=processed.dtype, device=processed.device)
        arg = torch.empty(b, dtype=torch.long, device=processed.device)
        step = max(1, _DENSE_ELEMENTS // max(1, v))
        for r0 in range(0, b, step):
            r1 = min(b, r0 + step)
            noisy = gumbel_noise(seeds[r0:r1], steps[r0:r1], v).add_(processed[r0:r1])
            best[r0:r1], arg[r0:r1] = noisy.max(dim=-1)
        return best, arg, chosen
    top = processed.argmax(-1)
    top_score = processed[rows, top] + gumbel_at(seeds, steps, rows, top, v)
    floor = torch.maximum(chosen, top_score) - GUMBEL_BOUND  # nothing below can win
    candidates = processed >= floor.unsqueeze(1)
    if int(candidates.sum()) * 8 > b * v:
        best, arg = (processed + gumbel_noise(seeds, steps, v)).max(dim=-1)
        return best, arg, chosen
    r, t = candidates.nonzero(as_tuple=True)
    sc = processed[r, t] + gumbel_at(seeds, steps, r, t, v)
    best = torch.full((b,), float("-inf"), device=processed.device).scatter_reduce(0, r, sc, "amax")
    win = sc == best[r]
    arg = torch.full((b,), v, dtype=torch.long, device=processed.device).scatter_reduce(0, r[win], t[win], "amin")
    return best, arg, chosen


@dataclass(frozen=True)
class TerminationCheck:
    """How a sequence ended, against the EOS rule and the length limit."""

    length: int
    """Generated tokens."""
    max_tokens: int
    """The length limit the task allowed."""
    ends_with_eos: bool
    """The last token is an EOS token (the sampling check says whether EOS won that draw)."""
    eos_before_end: tuple[int, ...]
    """Positions of EOS tokens before the last one: generation must stop at the first EOS."""
    stopped_early: bool
    """No EOS at the end and shorter than `max_tokens`: the node cut the sequence short."""
    over_limit: bool
    """Longer than `max_tokens`."""
    missed_eos: tuple[int, ...]
    """Positions where the replayed draw picks EOS but another token was submitted (beyond the
    sampling tolerance): the node should have stopped there. Empty without a sampling check."""
    eos_near_ties: tuple[int, ...] = ()
    """Positions where the replayed draw picks EOS and the submitted token, not EOS, lost by no more than the
    sampling tolerance: an EOS that won narrowly and was skipped. Not a violation by itself (the validator
    decides whether measured honest drift explains it). Empty without a sampling check."""
    replay_end: int | None = None
    """Tokens up to and including the first position where the replayed draw picks EOS (the whole length when
    it never does): what the node may be paid for. None without a sampling check."""

    @property
    def violations(self) -> tuple[str, ...]:
        """Names of the rules this sequence breaks (for logs and verdict reasons)."""
        out = []
        if self.eos_before_end:
            out.append("eos_before_end")
        if self.stopped_early:
            out.append("stopped_early")
        if self.over_limit:
            out.append("over_limit")
        if self.missed_eos:
            out.append("missed_eos")
        return tuple(out)


def check_termination(
    tokens: torch.Tensor | Sequence[int],
    eos_token_ids: Sequence[int],
    max_tokens: int,
    sampling: SamplingCheck | None = None,
) -> TerminationCheck:
    """Measure how `tokens` ended: EOS where EOS wins the draw, or exactly at the length limit."""
    import torch

    if max_tokens < 1:
        raise ProtocolError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = [int(t) for t in tokens.tolist()] if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    eos = set(int(e) for e in eos_token_ids)
    if not eos:
        raise ProtocolError("eos_token_ids is empty")
    n = len(ids)
    ends = n > 0 and ids[-1] in eos
    early_eos = tuple(i for i, t in enumerate(ids[:-1]) if t in eos)
    missed: tuple[int, ...] = ()
    near_eos: tuple[int, ...] = ()
    end: int | None = None
    if sampling is not None:
        if len(sampling.winners) != n:
            raise ProtocolError(f"sampling check covers {len(sampling.winners)} tokens, sequence has {n}")
        bad = set(sampling.mismatch_positions)
        missed = tuple(i for i, w in enumerate(sampling.winners) if w in eos and ids[i] not in eos and i in bad)
        near_eos = tuple(i for i in sampling.near_ties if sampling.winners[i] in eos and ids[i] not in eos)
        end = next((i + 1 for i, w in enumerate(sampling.winners) if w in eos), n)
    return TerminationCheck(
        length=n,
        max_tokens=max_tokens,
        ends_with_eos=ends,
        eos_before_end=early_eos,
        stopped_early=(not ends) and n < max_tokens,
        over_limit=n > max_tokens,
        missed_eos=missed,
        eos_near_ties=near_eos,
        replay_end=end,
    )
