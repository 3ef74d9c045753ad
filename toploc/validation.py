"""One prefill, then every measurement a validator needs for a batch of submitted sequences.

The node proves the final hidden states that produced its generated tokens (`prove`); the
validator re-runs the claimed policy over prompt + completion in one batched prefill
(`models.forward`), takes the same rows (positions len(prompt)-1 ... len(prompt)+n-2), and gets:

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
from toploc.sampling_check import SamplingCheck, TerminationCheck, check_sampling, check_termination
from toploc.thresholds import ToplocThresholds

if TYPE_CHECKING:
    import torch

    from models.loading import LoadedModel
    from models.sampling import SamplingParams

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
) -> list[SequenceReport]:
    """Measure every rollout with batched prefills of at most ~`batch_tokens` (padded) tokens (`timer`: see the
    module docstring)."""
    import torch

    from models.forward import prefill

    cfg = config or ToplocThresholds()
    reports: list[SequenceReport | None] = [None] * len(rollouts)
    todo = []
    for i, r in enumerate(rollouts):
        err = _precheck(loaded, r, cfg)
        if err is not None:
            reports[i] = SequenceReport((), None, None, err)
        else:
            todo.append(i)
    todo.sort(key=lambda i: len(rollouts[i].prompt_tokens) + len(rollouts[i].tokens))
    head = loaded.model.get_output_embeddings()  # type: ignore[no-untyped-call]
    groups: list[list[int]] = []
    for i in todo:
        length = len(rollouts[i].prompt_tokens) + len(rollouts[i].tokens) - 1
        if groups and (len(groups[-1]) + 1) * length <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    for group in groups:
        seqs = [list(rollouts[i].prompt_tokens) + list(rollouts[i].tokens[:-1]) for i in group]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):  # right padding: real positions start at 0 in every row
            ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[row, : len(s)] = 1
        try:
            with stage(timer, "measure.prefill"):
                out = prefill(loaded, ids, mask, logits_last_only=True)
        except ModelError as exc:  # prechecked, so this is the model failing: fail the group loudly
            raise ModelError(f"validation prefill failed: {exc}") from exc
        for row, i in enumerate(group):
            r = rollouts[i]
            start = len(r.prompt_tokens) - 1
            hidden = out.hidden[row, start : start + len(r.tokens)]
            with stage(timer, "measure.lm_head"), torch.inference_mode():
                logits = head(hidden).float()
            with stage(timer, "measure.logprobs"):
                reports[i] = _measure_one(r, hidden, logits, params, cfg, loaded.eos_token_ids, timer)
    return [r for r in reports if r is not None]


def _measure_one(
    r: Rollout,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    params: SamplingParams,
    cfg: ToplocThresholds,
    eos_token_ids: Sequence[int],
    timer: StageTimer | None = None,
) -> SequenceReport:
    import torch

    try:
        with stage(timer, "measure.toploc"):
            proofs = verify_proofs_bytes(hidden.to(torch.bfloat16), list(r.proofs), cfg.decode_batching_size,
                                         cfg.topk, skip_prefill=True)
    except ProofError as exc:
        return SequenceReport((), None, None, f"malformed proof: {exc}")
    from models.sampling import process_logits

    try:
        with stage(timer, "measure.sampling"):
            sampling = check_sampling(logits, list(r.tokens), params, r.seed,
                                      tolerance=cfg.sampling_margin_tolerance)
        with stage(timer, "measure.termination"):
            termination = check_termination(list(r.tokens), eos_token_ids, r.max_tokens, sampling)
    except ProtocolError as exc:
        return SequenceReport(tuple(proofs), None, None, f"malformed rollout: {exc}")
    processed = process_logits(logits, params)
    chosen = processed.gather(-1, torch.tensor(list(r.tokens), dtype=torch.long).unsqueeze(-1)).squeeze(-1)
    logprobs = (chosen - torch.logsumexp(processed, dim=-1)).tolist()
    return SequenceReport(tuple(proofs), sampling, termination, logprobs=tuple(float(x) for x in logprobs))
