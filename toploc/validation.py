"""One prefill, then every measurement a validator needs for a batch of submitted sequences.

The node proves the final hidden states that produced its generated tokens (`prove`); the
validator re-runs the claimed policy over prompt + completion in batched prefills
(`models.scoring.Scorer`: each distinct prompt once, its KV cache reused by every sample of it, on the
engine's measured kernels), takes the same rows (positions len(prompt)-1 ... len(prompt)+n-2), runs
the LM head and the seeded replay over the rows of all sequences at once (`_HEAD_ROWS` at a time, the
float32 logits of a block dropped once replayed), and gets:

- TOPLOC measurements per chunk of `decode_batching_size` generated tokens,
- the sampling replay (margins of every submitted token under the protocol seed),
- the termination measurements (EOS where EOS wins, or the length limit).

With a `protocol.timing.StageTimer` (`measure(..., timer=)`), `measure` fills exclusive seconds per stage:
`measure.prefill` (the model body), `measure.lm_head` (logits of the generated positions), `measure.toploc`
(proof verification), `measure.sampling` (the seeded replay), `measure.termination`, `measure.logprobs`
(replayed logprobs and per-sequence glue); batching and padding fall to the caller's enclosing stage.

Nothing here accepts or rejects: `ToplocThresholds` holds the limits and the validator decides.
A malformed submission (bad proof bytes, wrong proof count, token ids outside the vocabulary,
too long for the model) is reported per sequence in `SequenceReport.error`, never raised for the
whole batch, so one bad rollout cannot hide or crash the others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.errors import ModelError, ProofError, ProtocolError
from protocol.timing import StageTimer, stage
from toploc.proofs import VerificationResult, build_proofs_bytes, verify_proofs_bytes
from toploc.sampling_check import (
    SamplingCheck,
    TerminationCheck,
    check_seed,
    check_termination,
    replay_draws,
    sampling_check,
)
from toploc.thresholds import ToplocThresholds

if TYPE_CHECKING:
    import torch

    from models.loading import LoadedModel
    from models.sampling import SamplingParams
    from models.scoring import Scorer

logger = logging.getLogger(__name__)


def prove(hidden_states: torch.Tensor, config: ToplocThresholds | None = None) -> list[bytes]:
    """Node side: proofs for the hidden states [n, H] that produced n generated tokens (cast to bf16)."""
    import torch

    cfg = config or ToplocThresholds()
    return build_proofs_bytes(hidden_states.to(torch.bfloat16), cfg.decode_batching_size, cfg.topk,
                              skip_prefill=True)


@dataclass(frozen=True)
class Rollout:
    """One submitted sequence, as the validator receives it."""

    prompt_tokens: Sequence[int]
    """The prompt the task assigned (the validator rebuilds it; never taken from the node)."""
    tokens: Sequence[int]
    """The generated tokens the node submitted."""
    proofs: Sequence[bytes]
    """TOPLOC proofs of the hidden states that produced `tokens`."""
    seed: int
    """The protocol's sampling seed for this sequence (`protocol.seeds.sampling_seed`)."""
    max_tokens: int
    """The task's generation limit."""
    step_offset: int = 0
    """The sampler step of the first token (a multi-turn episode's later turn continues its sample's stream:
    the count of the episode's model tokens before it)."""
    tolerance: float | None = None
    """The sampling margin this rollout is measured with (the validator: its submission's declared precision's);
    None: the thresholds' `sampling_margin_tolerance`."""


@dataclass(frozen=True)
class SequenceReport:
    """Measurements for one rollout; `error` is set (and the rest empty) for a malformed one."""

    proofs: tuple[VerificationResult, ...]
    sampling: SamplingCheck | None
    termination: TerminationCheck | None
    error: str | None = None
    """Why the rollout could not be measured (a malformed proof or token list), else None."""
    logprobs: tuple[float, ...] = ()
    """The replayed sampling logprob of each submitted token (what the node should have reported)."""
    winner_logprobs: tuple[float, ...] = ()
    """The replayed sampling logprob of each position's `sampling.winners` token (the replay's own draw: where it
    picks an EOS the node replaced, the sample the policy drew ends there)."""


def _precheck(loaded: LoadedModel, r: Rollout, cfg: ToplocThresholds) -> str | None:
    vocab = loaded.vocab_size
    if not r.tokens:
        return "empty completion"
    if not r.prompt_tokens:
        return "empty prompt"
    for name, ids in (("prompt", r.prompt_tokens), ("completion", r.tokens)):
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            return f"{name} has token ids outside the vocabulary [0, {vocab})"
    if len(r.prompt_tokens) + len(r.tokens) - 1 > loaded.max_context:
        return f"sequence longer than the model's context ({loaded.max_context})"
    expected = -(-len(r.tokens) // cfg.decode_batching_size)
    if len(r.proofs) != expected:
        return f"got {len(r.proofs)} proofs for {len(r.tokens)} tokens (expected {expected})"
    return None


def measure(
    loaded: LoadedModel,
    rollouts: Sequence[Rollout],
    params: SamplingParams,
    config: ToplocThresholds | None = None,
    *,
    batch_tokens: int = 8192,
    timer: StageTimer | None = None,
    hidden_states: Sequence[torch.Tensor] | None = None,
) -> list[SequenceReport]:
    """Measure every rollout with batched prefills of at most ~`batch_tokens` (padded) tokens (`timer`: see the
    module docstring). `hidden_states[i]`: rollout i's rows ([len(tokens), H]) already computed by the caller's
    own prefill (a multi-turn episode's turns, all cut from one prefill over the whole sequence); no prefill
    then runs here."""
    import torch

    from models.scoring import Scorer

    cfg = config or ToplocThresholds()
    reports: list[SequenceReport | None] = [None] * len(rollouts)
    todo = []
    for i, r in enumerate(rollouts):
        err = _precheck(loaded, r, cfg)
        if err is not None:
            reports[i] = SequenceReport((), None, None, err)
        else:
            todo.append(i)
    if not todo:
        return [r for r in reports if r is not None]
    # The samples of a task share their prompt: each distinct prompt is prefilled once (models.scoring).
    prompt_ids: dict[tuple[int, ...], int] = {}
    for i in todo:
        prompt_ids.setdefault(tuple(rollouts[i].prompt_tokens), len(prompt_ids))
    if hidden_states is not None and len(hidden_states) != len(rollouts):
        raise ModelError(f"{len(hidden_states)} hidden-state blocks for {len(rollouts)} rollouts")
    try:
        with stage(timer, "measure.prefill"):
            scorer = Scorer.of(loaded)
            hiddens = [hidden_states[i] for i in todo] if hidden_states is not None else scorer.hidden(list(prompt_ids), [list(rollouts[i].tokens) for i in todo],
                                    [prompt_ids[tuple(rollouts[i].prompt_tokens)] for i in todo],
                                    batch_tokens=batch_tokens)
    except ModelError as exc:  # prechecked, so this is the model failing: fail the batch loudly
        raise ModelError(f"validation prefill failed: {exc}") from exc
    replay = []  # (index, hidden, TOPLOC results) of the rollouts whose proofs and seed parse
    for i, hidden in zip(todo, hiddens, strict=True):
        r = rollouts[i]
        try:
            with stage(timer, "measure.toploc"):
                proofs = verify_proofs_bytes(hidden.to(torch.bfloat16), list(r.proofs), cfg.decode_batching_size,
                                             cfg.topk, skip_prefill=True)
        except ProofError as exc:
            reports[i] = SequenceReport((), None, None, f"malformed proof: {exc}")
            continue
        try:
            check_seed(r.seed)
        except ProtocolError as exc:
            reports[i] = SequenceReport(tuple(proofs), None, None, f"malformed rollout: {exc}")
            continue
        replay.append((i, hidden, proofs))
    if not replay:
        return [r for r in reports if r is not None]
    margins, winners, logprobs, won = _replay(scorer, [(rollouts[i], h) for i, h, _ in replay], params, timer)
    at = 0
    for i, _, proofs in replay:
        r = rollouts[i]
        n = len(r.tokens)
        with stage(timer, "measure.sampling"):
            sampling = sampling_check(margins[at : at + n], winners[at : at + n], list(r.tokens),
                                      cfg.sampling_margin_tolerance if r.tolerance is None else r.tolerance)
        with stage(timer, "measure.termination"):
            termination = check_termination(list(r.tokens), eos_token_ids=loaded.eos_token_ids,
                                            max_tokens=r.max_tokens, sampling=sampling)
        with stage(timer, "measure.logprobs"):
            reports[i] = SequenceReport(tuple(proofs), sampling, termination, logprobs=tuple(logprobs[at : at + n]),
                                        winner_logprobs=tuple(won[at : at + n]))
        at += n
    return [r for r in reports if r is not None]


_HEAD_ROWS = 256
"""Rows per LM head call: bounds the [rows, vocab] float32 logits (256 x 49,152 = 50 MB) while the head's
matmul still reads its weight once for many rows."""


def _replay(
    scorer: Scorer, items: list[tuple[Rollout, torch.Tensor]], params: SamplingParams, timer: StageTimer | None
) -> tuple[list[float], list[int], list[float], list[float]]:
    """(margins, winners, sampling logprobs, the winners' sampling logprobs) of every submitted token of `items`,
    in order: the LM head and the seeded replay over the rows of all sequences at once, `_HEAD_ROWS` at a time."""
    import torch

    from models.sampling import process_logits

    with stage(timer, "measure.logprobs"):
        hidden = torch.cat([h for _, h in items])
        tokens = torch.tensor([t for r, _ in items for t in r.tokens], dtype=torch.long, device=hidden.device)
        seeds = torch.tensor([r.seed for r, _ in items for _ in r.tokens], dtype=torch.long, device=hidden.device)
        steps = torch.cat([torch.arange(r.step_offset, r.step_offset + len(r.tokens), dtype=torch.long)
                           for r, _ in items]).to(hidden.device)
    margins: list[float] = []
    winners: list[int] = []
    logprobs: list[float] = []
    won: list[float] = []
    for r0 in range(0, hidden.shape[0], _HEAD_ROWS):
        r1 = min(hidden.shape[0], r0 + _HEAD_ROWS)
        with stage(timer, "measure.lm_head"):
            logits = scorer.logits(hidden[r0:r1])
        with stage(timer, "measure.sampling"):
            processed = process_logits(logits, params)
            margin, arg = replay_draws(processed, tokens[r0:r1], params, seeds[r0:r1], steps[r0:r1])
            margins.extend(margin.tolist())
            winners.extend(arg.tolist())
        with stage(timer, "measure.logprobs"):
            norm = torch.logsumexp(processed, dim=-1)
            chosen = processed.gather(-1, tokens[r0:r1, None]).squeeze(-1)
            logprobs.extend((chosen - norm).tolist())
            won.extend((processed.gather(-1, arg[:, None].to(torch.long)).squeeze(-1) - norm).tolist())
    return margins, winners, logprobs, won
