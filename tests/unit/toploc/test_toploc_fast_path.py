"""The validator's fast check path (`toploc.validation.measure`: shared-prompt prefill on the engine's kernels,
the LM head and the sampling replay over the rows of a whole batch) measures what the plain path measures: one
`models.forward.prefill` per sequence, the Hugging Face LM head and `check_sampling` per sequence (the path
`measure` took before issue 25, kept here as the reference). Honest rollouts and cheats of every kind, with
shared prompts; the verdict inputs must be the same, so a later speedup cannot change what is caught unnoticed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from models import load
from models.engine import Engine, Generation
from models.forward import prefill
from models.loading import LoadedModel, output_head
from models.sampling import SamplingParams, process_logits
from protocol.errors import ProofError, ProtocolError
from protocol.model_spec import TinyModelSpec
from toploc import ToplocThresholds, verify_proofs_bytes
from toploc.sampling_check import check_sampling, check_termination
from toploc.validation import Rollout, SequenceReport, _precheck, measure, prove

SPEC = TinyModelSpec(seed=0, hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=512)
CFG = ToplocThresholds()
MAX_TOKENS = 40


def reference_measure(loaded: LoadedModel, rollouts: Sequence[Rollout], params: SamplingParams) -> list[SequenceReport]:
    """Each rollout alone: a prefill over prompt + completion, the model's LM head, the per-sequence replay."""
    out = []
    head = output_head(loaded.model)
    for r in rollouts:
        err = _precheck(loaded, r, CFG)
        if err is not None:
            out.append(SequenceReport((), None, None, err))
            continue
        seq = list(r.prompt_tokens) + list(r.tokens[:-1])
        res = prefill(loaded, torch.tensor([seq]), logits_last_only=True)
        start = len(r.prompt_tokens) - 1
        hidden = res.hidden[0, start : start + len(r.tokens)]
        with torch.inference_mode():
            logits = head(hidden).float()
        try:
            proofs = verify_proofs_bytes(hidden.to(torch.bfloat16), list(r.proofs), CFG.decode_batching_size,
                                         CFG.topk, skip_prefill=True)
        except ProofError as exc:
            out.append(SequenceReport((), None, None, f"malformed proof: {exc}"))
            continue
        try:
            sampling = check_sampling(logits, list(r.tokens), params, r.seed, tolerance=CFG.sampling_margin_tolerance)
        except ProtocolError as exc:
            out.append(SequenceReport(tuple(proofs), None, None, f"malformed rollout: {exc}"))
            continue
        termination = check_termination(list(r.tokens), loaded.eos_token_ids, r.max_tokens, sampling)
        processed = process_logits(logits, params)
        chosen = processed.gather(-1, torch.tensor(list(r.tokens))[:, None]).squeeze(-1)
        logprobs = (chosen - torch.logsumexp(processed, dim=-1)).tolist()
        out.append(SequenceReport(tuple(proofs), sampling, termination, logprobs=tuple(logprobs)))
    return out


def submissions(loaded: LoadedModel, params: SamplingParams) -> list[Rollout]:
    """4 tasks x 4 samples sharing each task's prompt (honest), then cheats on copies of them."""
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 5, 6, 7] + torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(6, 30, (4,), generator=g)]
    gens: list[Generation] = Engine(loaded).generate(
        [p for p in prompts for _ in range(4)], params, [1000 + i for i in range(16)], MAX_TOKENS)
    honest = [Rollout(x.prompt_tokens, x.tokens, prove(x.hidden_states, CFG), x.seed, MAX_TOKENS) for x in gens]
    other = load(SPEC.model_copy(update={"seed": 9}), dtype=str(loaded.dtype).removeprefix("torch."))
    foreign = Engine(other).generate(prompts[:2], params, [7, 8], MAX_TOKENS)
    a, b = honest[0], honest[5]
    edited = list(a.tokens)
    edited[len(edited) // 2] = (edited[len(edited) // 2] + 1) % 512
    cheats = [
        Rollout(a.prompt_tokens, edited, a.proofs, a.seed, MAX_TOKENS),  # a hand edit
        Rollout(a.prompt_tokens, a.tokens, a.proofs, a.seed + 1, MAX_TOKENS),  # another seed (cherry-picking)
        Rollout(a.prompt_tokens, a.tokens, b.proofs[: len(a.proofs)] * 2, a.seed, MAX_TOKENS),  # wrong proofs
        Rollout(a.prompt_tokens, a.tokens[:-3], prove(gens[0].hidden_states[:-3], CFG), a.seed, MAX_TOKENS),  # cut
        Rollout(a.prompt_tokens, a.tokens, [b"\x00" * 258] * len(a.proofs), a.seed, MAX_TOKENS),  # junk proof bytes
        Rollout(a.prompt_tokens, a.tokens, a.proofs, 2**63, MAX_TOKENS),  # a seed outside the protocol's range
        Rollout(a.prompt_tokens, [], [], a.seed, MAX_TOKENS),  # empty
        *[Rollout(x.prompt_tokens, x.tokens, prove(x.hidden_states, CFG), a.seed, MAX_TOKENS) for x in foreign],
    ]
    return honest + cheats


def _verdict(th: ToplocThresholds, r: SequenceReport) -> tuple[object, ...]:
    if r.error is not None:
        return ("error", r.error)
    assert r.sampling is not None and r.termination is not None
    return (tuple(th.failing_chunks(list(r.proofs))), th.sampling_failed(r.sampling), r.termination.violations,
            r.termination.replay_end, r.sampling.mismatch_positions, r.sampling.near_ties, r.termination.eos_near_ties)


# fp32 with top-k (the replay's sparse branch; measurements must be equal), bf16 at T = 1 (the dense branch)
@pytest.mark.parametrize(("dtype", "params"), [("float32", SamplingParams(temperature=0.7, top_k=20)),
                                               ("bfloat16", SamplingParams(temperature=1.0))], ids=["fp32-topk", "bf16-t1"])
def test_the_fast_path_measures_what_the_per_sequence_path_measures(dtype: str, params: SamplingParams) -> None:
    loaded = load(SPEC, dtype=dtype)
    rollouts = submissions(loaded, params)
    fast = measure(loaded, rollouts, params, CFG, batch_tokens=600)  # several batches, a prompt split over two
    ref = reference_measure(loaded, rollouts, params)
    assert len(fast) == len(ref) == len(rollouts)
    verdicts = [_verdict(CFG, r) for r in ref]
    assert [_verdict(CFG, r) for r in fast] == verdicts
    if params.top_k == 0:  # (at a top-k boundary a bf16 honest token can fall out of the set on either path)
        assert all(v[:3] == ((), False, ()) for v in verdicts[:16])  # the honest ones pass
    assert sum(bool(v[0] != "error" and (v[0] or v[1] or v[2])) for v in verdicts[16:]) >= 4  # the cheats are caught
    for f, r in zip(fast, ref, strict=True):
        assert f.error == r.error
        got = [(p.exp_mismatches, p.mant_err_mean, p.mant_err_median) for p in f.proofs]
        want = [(p.exp_mismatches, p.mant_err_mean, p.mant_err_median) for p in r.proofs]
        if dtype == "float32":  # fp32 kernels differ in summation order only: the bf16 proofs see no difference
            assert got == want
        else:  # the engine's bf16 kernels round differently from transformers': a drift far inside the limits
            assert len(got) == len(want)
            for (e1, m1, d1), (e2, m2, d2) in zip(got, want, strict=True):
                if e2 > CFG.max_exp_mismatches:
                    continue  # far over the limits on both paths (the verdicts above are equal): noisy statistics
                assert abs(e1 - e2) <= 3 and abs(m1 - m2) <= 0.2 and abs(d1 - d2) <= 1, (got, want)
        if r.sampling is None:
            continue
        assert f.sampling is not None and f.termination == r.termination
        assert f.sampling.winners == r.sampling.winners
        # bf16 logits one rounding apart: margins and logprobs a few hundredths apart, against tolerances of 0.5
        tol = 1e-4 if dtype == "float32" else 0.1
        for x, y in zip(f.sampling.margins, r.sampling.margins, strict=True):
            assert x == y or math.isclose(x, y, abs_tol=tol)
        assert f.logprobs == pytest.approx(r.logprobs, abs=tol)
