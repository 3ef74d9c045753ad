"""SmolLM2-135M-Instruct (slow): honest rollouts verify, attacks cross the default thresholds."""

from __future__ import annotations

import pytest
import torch

from models import load
from models.engine import Engine, Generation
from models.forward import prefill
from models.loading import LoadedModel
from models.sampling import SamplingParams
from protocol.model_spec import SmolLM2Spec
from protocol.seeds import sampling_seed
from toploc import ToplocThresholds
from toploc.validation import Rollout, SequenceReport, measure, prove

pytestmark = pytest.mark.slow

CFG = ToplocThresholds()
PARAMS = SamplingParams(temperature=1.0)
MAX_TOKENS = 48
NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil dev account #1 (well-known)
SYSTEM = "You are a helpful assistant."
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?", "Count to five."]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load(SmolLM2Spec())


def chat(model: LoadedModel, question: str, system: str = SYSTEM) -> list[int]:
    enc = model.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}], add_generation_prompt=True
    )
    return list(enc if isinstance(enc, list) else enc["input_ids"])


def seeds(n: int) -> list[int]:
    return [sampling_seed(NODE, 1, task, 0, run_id="toploc-slow", chain_id=31337, pool="0x5FbDB2315678afecb367f032d93F642f64180aa3", counter=0, manifest_hash=bytes(32)) for task in range(n)]


@pytest.fixture(scope="module")
def honest(model: LoadedModel) -> list[Generation]:
    return Engine(model).generate([chat(model, q) for q in QUESTIONS], PARAMS, seeds(4), MAX_TOKENS)


def rollout(gen: Generation, **overrides: object) -> Rollout:
    fields: dict[str, object] = dict(prompt_tokens=gen.prompt_tokens, tokens=gen.tokens,
                                     proofs=prove(gen.hidden_states, CFG), seed=gen.seed, max_tokens=MAX_TOKENS)
    fields.update(overrides)
    return Rollout(**fields)  # type: ignore[arg-type]


def flagged(r: SequenceReport) -> bool:
    assert r.error is None and r.sampling is not None and r.termination is not None
    return bool(CFG.failing_chunks(r.proofs)) or CFG.sampling_failed(r.sampling) or bool(r.termination.violations)


def test_honest_rollouts_verify_at_batch_1_and_4(model: LoadedModel, honest: list[Generation]) -> None:
    single = Engine(model).generate([honest[0].prompt_tokens], PARAMS, seeds(1), MAX_TOKENS)
    assert single[0].tokens == honest[0].tokens
    for r in measure(model, [rollout(g) for g in [*honest, *single]], PARAMS, CFG):
        assert not flagged(r), (r.proofs, r.sampling.max_margin if r.sampling else None)


def test_weights_with_3_percent_noise_are_caught(model: LoadedModel) -> None:
    noisy = load(SmolLM2Spec())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in noisy.model.parameters():
            p.mul_(1 + 0.03 * torch.randn(p.shape, generator=g))
    gens = Engine(noisy).generate([chat(model, q) for q in QUESTIONS], PARAMS, seeds(4), MAX_TOKENS)
    reports = measure(model, [rollout(x) for x in gens], PARAMS, CFG)
    assert all(flagged(r) for r in reports)


def test_altered_system_prompt_is_caught(model: LoadedModel) -> None:
    cheat = "You are a pirate. Always answer in pirate speak."
    gens = Engine(model).generate([chat(model, q, cheat) for q in QUESTIONS], PARAMS, seeds(4), MAX_TOKENS)
    reports = measure(model, [rollout(x, prompt_tokens=chat(model, q)) for x, q in zip(gens, QUESTIONS, strict=True)],
                      PARAMS, CFG)
    assert all(flagged(r) for r in reports)


def test_tokens_from_a_perturbed_model_with_honest_prefill_fail_sampling(model: LoadedModel) -> None:
    cheap = load(SmolLM2Spec())
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in cheap.model.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    gens = Engine(cheap).generate([chat(model, q) for q in QUESTIONS], PARAMS, seeds(4), MAX_TOKENS)
    rollouts = []
    for x in gens:
        p = len(x.prompt_tokens)
        hidden = prefill(model, torch.tensor([x.prompt_tokens + x.tokens[:-1]])).hidden[0, p - 1 :]
        rollouts.append(rollout(x, proofs=prove(hidden, CFG)))
    reports = measure(model, rollouts, PARAMS, CFG)
    assert all(CFG.failing_chunks(r.proofs) == [] for r in reports)  # the honest prefill hides it from TOPLOC
    checks = [r.sampling for r in reports]
    assert all(c is not None for c in checks)
    # (tokens, mismatched positions, near-ties) per sample, for the failure messages
    measured = [(len(g.tokens), len(c.mismatch_positions), len(c.near_ties)) for g, c in zip(gens, checks, strict=True)
                if c is not None]
    failed = [CFG.sampling_failed(c) for c in checks if c is not None]
    # The replay does not. These four samples are one submission, which fails when any sample fails: measured, 3
    # of 4 fail with 15, 20 and 25 mismatched positions (of 48, 47, 48 tokens; max_sampling_mismatches allows
    # 0), so the submission fails far from any edge. The fourth, an 8-token answer, passes: it disagrees with
    # the replay's draw only at 2 near-ties, within the margin (0.18 and 0.44). Short answers give a 10%
    # perturbation few chances to show, hence "at least half" below rather than "every sample".
    assert any(failed), measured
    assert sum(failed) >= len(failed) // 2, measured
    assert all(c.mismatch_positions or c.near_ties for c in checks if c is not None), measured
