"""The generation engine: batching invariance, replayable sampling, stops, captured hidden states."""

from __future__ import annotations

import pytest
import torch

from models import LoadedModel
from models.engine import Engine, Generation
from models.forward import prefill
from models.sampling import SamplingParams, sample
from protocol.errors import ModelError

PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 40, 41], [1] + list(range(100, 130)), [1, 77]]
SEEDS = [3, 4, 5, 6]


def _check_against_prefill(m: LoadedModel, g: Generation, params: SamplingParams, tol: float) -> None:
    """A verifier's view: one prefill over prompt + completion reproduces hidden states and tokens."""
    n, start = len(g.tokens), len(g.prompt_tokens) - 1
    out = prefill(m, torch.tensor([g.prompt_tokens + g.tokens]))
    hidden = out.hidden[0, start : start + n]
    assert g.hidden_states.shape == (n, m.hidden_size) and g.hidden_states.dtype == m.dtype
    torch.testing.assert_close(g.hidden_states.float(), hidden.float(), rtol=tol, atol=tol)
    logits = out.logits[0, start : start + n]
    tokens, logprobs = sample(logits, params, torch.full((n,), g.seed), torch.arange(n))
    assert tokens.tolist() == g.tokens
    torch.testing.assert_close(logprobs, torch.tensor(g.logprobs), rtol=tol, atol=tol)


@pytest.mark.parametrize("fast", [True, False])
def test_batch_equals_each_alone_and_replays(tiny: LoadedModel, fast: bool) -> None:
    engine = Engine(tiny, fast_path=fast)
    params = SamplingParams(temperature=0.9, top_k=100)
    batch = engine.generate(PROMPTS, params, SEEDS, 24)
    for prompt, seed, g in zip(PROMPTS, SEEDS, batch, strict=True):
        alone = engine.generate([prompt], params, [seed], 24)[0]
        assert g.prompt_tokens == prompt and g.seed == seed
        assert g.tokens == alone.tokens and g.finish_reason == alone.finish_reason
        torch.testing.assert_close(g.hidden_states, alone.hidden_states, rtol=1e-5, atol=1e-5)
        _check_against_prefill(tiny, g, params, 1e-5)
    again = engine.generate(PROMPTS, params, SEEDS, 24)
    assert [g.tokens for g in again] == [g.tokens for g in batch]
    other = engine.generate(PROMPTS, params, [s + 100 for s in SEEDS], 24)
    assert [g.tokens for g in other] != [g.tokens for g in batch]


def test_fast_and_generic_paths_agree(tiny: LoadedModel) -> None:
    params = SamplingParams()
    a = Engine(tiny, fast_path=True).generate(PROMPTS, params, SEEDS, 16)
    b = Engine(tiny, fast_path=False).generate(PROMPTS, params, SEEDS, 16)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        torch.testing.assert_close(x.hidden_states, y.hidden_states, rtol=1e-5, atol=1e-5)


def test_bf16_engine_matches_prefill_within_bf16_tolerance(tiny_bf16: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0)  # greedy: the token check is robust to bf16 noise
    for g in Engine(tiny_bf16).generate(PROMPTS, params, SEEDS, 16):
        assert g.hidden_states.dtype == torch.bfloat16
        _check_against_prefill(tiny_bf16, g, params, 3e-2)


@pytest.mark.parametrize("fast", [True, False])
def test_eos_and_length_stops(tiny: LoadedModel, fast: bool) -> None:
    engine = Engine(tiny, fast_path=fast)
    seeds = list(range(24))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in seeds]
    gens = engine.generate(prompts, SamplingParams(temperature=3.0), seeds, 120)
    eos = [g for g in gens if g.finish_reason == "eos"]
    length = [g for g in gens if g.finish_reason == "length"]
    assert eos and length  # hot sampling over 512 tokens: some sequences hit <eos> (id 2), some do not
    for g in eos:
        assert g.tokens[-1] == 2 and 2 not in g.tokens[:-1] and len(g.tokens) <= 120
        assert len(g.logprobs) == len(g.tokens) == g.hidden_states.shape[0]
    for g in length:
        assert len(g.tokens) == 120 and 2 not in g.tokens
    # finished sequences left the batch without disturbing the others
    for i in (0, 5, 11):
        alone = engine.generate([prompts[i]], SamplingParams(temperature=3.0), [seeds[i]], 120)[0]
        assert alone.tokens == gens[i].tokens


def test_greedy_is_argmax(tiny: LoadedModel) -> None:
    g = Engine(tiny).generate([PROMPTS[0]], SamplingParams(temperature=0.0), [0], 8)[0]
    ids = list(PROMPTS[0])
    for tok in g.tokens:
        nxt = int(prefill(tiny, torch.tensor([ids])).logits[0, -1].argmax())
        assert nxt == tok
        ids.append(nxt)


def test_engine_rejects_bad_requests(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    with pytest.raises(ModelError, match="context"):
        engine.generate([[1] * (tiny.max_context - 5)], SamplingParams(), [0], 10)
    with pytest.raises(ModelError):
        engine.generate([[1, 2]], SamplingParams(), [0, 1], 4)
    with pytest.raises(ModelError):
        engine.generate([[]], SamplingParams(), [0], 4)
    with pytest.raises(ModelError):
        engine.generate([[1, 9999]], SamplingParams(), [0], 4)
    with pytest.raises(ModelError):
        engine.generate([[1]], SamplingParams(), [0], 0)
    with pytest.raises(ModelError):
        engine.generate([[1]], SamplingParams(), [1 << 64], 4)
    assert engine.generate([], SamplingParams(), [], 4) == []


def test_uint64_seed_keeps_its_bits(tiny: LoadedModel) -> None:
    """A protocol seed in [2**63, 2**64) samples as the same 64 bits read as a signed int."""
    engine = Engine(tiny)
    big = engine.generate([PROMPTS[0]], SamplingParams(), [(1 << 64) - 5], 8)[0]
    signed = engine.generate([PROMPTS[0]], SamplingParams(), [-5], 8)[0]
    assert big.tokens == signed.tokens and big.seed == (1 << 64) - 5
    _check_against_prefill(tiny, signed, SamplingParams(), 1e-5)


def test_prefill_in_row_groups_matches_one_group(tiny: LoadedModel) -> None:
    small = Engine(tiny, prefill_tokens=40).generate(PROMPTS, SamplingParams(), SEEDS, 8)
    big = Engine(tiny).generate(PROMPTS, SamplingParams(), SEEDS, 8)
    assert [g.tokens for g in small] == [g.tokens for g in big]


@pytest.mark.parametrize("fast", [True, False])
def test_step_offsets_continue_a_sampler_stream(tiny: LoadedModel, fast: bool) -> None:
    # a multi-turn episode's later turn: token i of a sequence is drawn at sampler step offset + i, in a batch
    # whose rows carry different offsets (and rows leave the batch at EOS)
    engine = Engine(tiny, fast_path=fast)
    params = SamplingParams(temperature=1.0)
    offsets = [0, 17, 5, 1000]
    batch = engine.generate(PROMPTS, params, SEEDS, 16, offsets)
    for prompt, seed, off, g in zip(PROMPTS, SEEDS, offsets, batch, strict=True):
        n, start = len(g.tokens), len(prompt) - 1
        logits = prefill(tiny, torch.tensor([prompt + g.tokens])).logits[0, start : start + n]
        tokens, _ = sample(logits, params, torch.full((n,), seed), torch.arange(off, off + n))
        assert tokens.tolist() == g.tokens
    assert batch[0].tokens == engine.generate(PROMPTS[:1], params, SEEDS[:1], 16)[0].tokens  # offset 0: as before
    assert [g.tokens for g in batch[1:]] != [g.tokens for g in engine.generate(PROMPTS[1:], params, SEEDS[1:], 16)]
    with pytest.raises(ModelError, match="step offset"):
        engine.generate(PROMPTS, params, SEEDS, 4, [0])
