"""The seeded Gumbel-max sampler: exact replay, correct distribution, masking, cross-process determinism."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models.sampling as sampling
from models.sampling import (
    GUMBEL_BOUND,
    SamplingParams,
    gumbel_at,
    gumbel_noise,
    process_logits,
    row_keys,
    sample,
    scores,
    uniform_bits,
    uniforms,
)

M32 = (1 << 32) - 1


@pytest.fixture(params=["compiled", "torch"])
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each path of the sampler's search (models/gumbel_cpu.py, and torch): the same tokens."""
    monkeypatch.setenv("PRIME_SAMPLER", str(request.param))  # whatever the batch's size
    if request.param == "compiled":
        assert sampling._compiled_search(1) is not None, "numba is a dependency: the compiled search must load"
    return str(request.param)


def reference_bits(seed: int, step: int, token: int) -> int:
    """The documented hash, written independently with Python integers."""
    k1, k2 = row_keys(seed, step)
    x = (k1 + token * 0x9E3779B9) & M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= k2
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def test_hash_matches_the_documented_integer_reference() -> None:
    seeds = torch.tensor([0, 1, 12345, -1, 2**62, -(2**63)])
    steps = torch.tensor([0, 0, 5, 7, 100, 2**40])
    bits = uniform_bits(seeds, steps, 3000)
    u = uniforms(seeds, steps, 3000)
    for i in range(len(seeds)):
        for v in (0, 1, 2, 255, 1024, 2999):
            want = reference_bits(int(seeds[i]), int(steps[i]), v)
            assert int(bits[i, v]) & M32 == want
            assert float(u[i, v]) == ((want >> 9) + 0.5) / 2**23


def test_uniforms_strictly_inside_unit_interval_and_distinct_per_row() -> None:
    u = uniforms(torch.arange(4), torch.zeros(4, dtype=torch.long), 50_000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    bits = uniform_bits(torch.arange(4), torch.zeros(4, dtype=torch.long), 50_000)
    for row in bits:
        assert row.unique().numel() == row.numel()  # a bijection of the token id
    g = gumbel_noise(torch.arange(16), torch.zeros(16, dtype=torch.long), 20_000)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.01


def test_sample_replays_bit_exactly() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=gen) * 3
    seeds = torch.tensor([11, 12, 13, 14, 15, 16, 17, 2**63 - 1])
    steps = torch.arange(8)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    t1, lp1 = sample(logits, params, seeds, steps)
    t2, lp2 = sample(logits.clone(), params, seeds.clone(), steps.clone())
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2)
    s = scores(logits, params, seeds, steps)
    assert torch.equal(s.argmax(-1), t1)
    # rows are independent of their batch neighbours
    t_one, lp_one = sample(logits[3:4], params, seeds[3:4], steps[3:4])
    assert int(t_one) == int(t1[3]) and float(lp_one) == float(lp1[3])
    # a different seed or step gives different noise
    assert not torch.equal(gumbel_noise(seeds, steps, 300), gumbel_noise(seeds + 1, steps, 300))
    assert not torch.equal(gumbel_noise(seeds, steps, 300), gumbel_noise(seeds, steps + 1, 300))


def test_logprob_is_that_of_the_sampling_distribution() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=10)
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.long)
    tokens, lps = sample(logits, params, seeds, steps)
    want = torch.log_softmax(process_logits(logits, params), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(lps, want)


def test_empirical_frequencies_follow_softmax(search: str) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    params = SamplingParams(temperature=1.0)
    tokens, _ = sample(logits.expand(n, -1), params, torch.arange(n), torch.full((n,), 7))
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits.double(), -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (counts, expected)  # 5 dof: p(chi2 > 30) ~ 1.5e-5
    # the same over steps with one seed (the noise must also be fresh along a sequence)
    tokens, _ = sample(logits.expand(n, -1), params, torch.full((n,), 99), torch.arange(n))
    counts = torch.bincount(tokens, minlength=6).double()
    assert float(((counts - expected) ** 2 / expected).sum()) < 30.0


def test_temperature_sharpens(search: str) -> None:
    logits = torch.tensor([1.0, 0.0])
    n = 10_000
    cold, _ = sample(
        logits.expand(n, -1),
        SamplingParams(temperature=0.25),
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
    )
    p_cold = float((cold == 0).double().mean())
    assert abs(p_cold - float(torch.softmax(logits / 0.25, -1)[0])) < 0.02


def test_top_k_masks_and_is_never_exceeded() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    p = process_logits(logits, SamplingParams(top_k=3))
    assert torch.isinf(p[0, 3:]).all() and torch.isfinite(p[0, :3]).all()
    n = 5000
    flat = torch.zeros(n, 6)
    tokens, _ = sample(flat, SamplingParams(top_k=2), torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert set(tokens.tolist()) == set(range(6))  # ties at the k-th value are all kept
    tokens, _ = sample(
        logits.expand(n, -1), SamplingParams(top_k=2), torch.arange(n), torch.zeros(n, dtype=torch.long)
    )
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    p = process_logits(logits, SamplingParams(top_p=0.75))
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p = process_logits(logits, SamplingParams(top_p=0.81))
    assert torch.isfinite(p[0, :3]).all() and torch.isinf(p[0, 3])
    p = process_logits(logits, SamplingParams(top_p=0.1))  # always keeps the most likely token
    assert torch.isfinite(p[0, 0]) and torch.isinf(p[0, 1:]).all()
    # order in the vocabulary does not matter
    shuffled = logits[:, [3, 1, 0, 2]]
    p = process_logits(shuffled, SamplingParams(top_p=0.75))
    assert torch.isfinite(p[0, [1, 2]]).all() and torch.isinf(p[0, [0, 3]]).all()


def test_greedy_is_argmax_with_plain_logprob() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    tokens, lps = sample(
        logits, SamplingParams(temperature=0.0, top_k=3), torch.arange(5), torch.zeros(5, dtype=torch.long)
    )
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).max(-1).values)


def test_params_validated() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=1, extra=1)  # type: ignore[call-arg]


_DIGEST_SNIPPET = """
import hashlib, torch
from models.sampling import gumbel_noise
g = gumbel_noise(torch.tensor([1, 2**40, -5]), torch.tensor([0, 3, 999]), 4096)
print(hashlib.sha256(g.numpy().tobytes()).hexdigest())
"""


def test_noise_identical_in_another_process() -> None:
    g = gumbel_noise(torch.tensor([1, 2**40, -5]), torch.tensor([0, 3, 999]), 4096)
    here = hashlib.sha256(g.numpy().tobytes()).hexdigest()
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST_SNIPPET],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert out.stdout.strip() == here


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0, 20.0])
def test_pruned_sampling_equals_full_scores_argmax(scale: float, search: str) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(32, 5000, generator=gen) * scale
    logits[:, 7] += 2 * scale  # a clear favourite in some rows
    for params in (SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(top_k=40, top_p=0.8)):
        seeds, steps = torch.arange(32) * 7919, torch.arange(32) % 5
        tokens, _ = sample(logits, params, seeds, steps)
        assert torch.equal(tokens, scores(logits, params, seeds, steps).argmax(-1))


def test_gumbel_at_equals_dense_noise() -> None:
    seeds, steps = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    dense = gumbel_noise(seeds, steps, 1000)
    rows = torch.tensor([0, 2, 1, 2, 0])
    toks = torch.tensor([999, 0, 17, 500, 3])
    assert torch.equal(gumbel_at(seeds, steps, rows, toks, 1000), dense[rows, toks])
    assert float(dense.max()) < GUMBEL_BOUND


def _near_tie_rows(vocab: int, winner: int, rival: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose `rival` scores within a few ulps of `winner` (below, equal, above), on a spread of logits."""
    gen = torch.Generator().manual_seed(vocab + winner + rival)
    base = torch.randn(vocab, generator=gen) * 0.5 - 10.0  # nobody else comes near
    base[winner] = 9.0
    seed, step = 424242, 3
    g = gumbel_at(torch.tensor([seed]), torch.tensor([step]), torch.tensor([0, 0]), torch.tensor([winner, rival]), vocab)
    target = base[winner] + g[0]  # the winner's exact float32 score
    rows = []
    x = target - g[1]
    for _ in range(4):  # walk down a few ulps, then up through the tie and past it
        x = torch.nextafter(x, torch.tensor(float("-inf")))
    for _ in range(9):
        row = base.clone()
        row[rival] = x
        rows.append(row)
        x = torch.nextafter(x, torch.tensor(float("inf")))
    n = len(rows)
    return torch.stack(rows), torch.full((n,), seed), torch.full((n,), step)


@pytest.mark.parametrize(("winner", "rival"), [(10, 4000), (4000, 10)])
def test_pruned_sampling_agrees_with_full_scores_on_ties_and_one_ulp_margins(winner: int, rival: int, search: str) -> None:
    """At temperature 1 with no top-k/top-p the sampler takes logs only where a token can win; where two scores
    tie or differ by an ulp it still picks the full scores' argmax (a tie: the lower id, as torch.argmax)."""
    logits, seeds, steps = _near_tie_rows(5000, winner, rival)
    full = scores(logits, SamplingParams(), seeds, steps)
    tokens, _ = sample(logits, SamplingParams(), seeds, steps)
    assert torch.equal(tokens, full.argmax(-1))
    assert {int(t) for t in tokens} == {winner, rival}  # the rows do cross from one winner to the other
    assert bool((full[:, winner] == full[:, rival]).any())  # and one of them is an exact tie


@pytest.mark.parametrize("offset", [0.0, -3000.0, 5000.0])
def test_pruned_sampling_agrees_on_lm_like_rows_at_any_logit_offset(offset: float, search: str) -> None:
    """Rows shaped like an LM's (a few likely tokens, a long tail), shifted by a large offset (float rounding grows
    with the logits' magnitude: the margin must grow with it)."""
    gen = torch.Generator().manual_seed(int(offset) + 7)
    vocab = 49152
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = []
    for r in range(12):
        perm = torch.randperm(vocab, generator=gen)
        rows.append((-1.1 * ranks.log() * (0.5 + r / 8))[perm] + offset)
    logits = torch.stack(rows)
    seeds, steps = torch.arange(12) * 104729 + 1, torch.arange(12) * 3
    tokens, _ = sample(logits, SamplingParams(), seeds, steps)
    assert torch.equal(tokens, scores(logits, SamplingParams(), seeds, steps).argmax(-1))


def test_pruned_sampling_takes_logs_for_few_tokens(monkeypatch: pytest.MonkeyPatch, search: str) -> None:
    """The point of the pruning: on a peaked 49152-token row, well under 1% of the tokens get a Gumbel value."""
    seen: list[int] = []
    exact = sampling._bits_to_gumbel

    def counted(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.numel())
        return exact(x)

    monkeypatch.setattr(sampling, "_bits_to_gumbel", counted)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49152, generator=gen) * 3.0
    seeds, steps = torch.arange(8) + 11, torch.zeros(8, dtype=torch.long)
    tokens, _ = sample(logits, SamplingParams(), seeds, steps)
    assert torch.equal(tokens, scores(logits, SamplingParams(), seeds, steps).argmax(-1))
    assert 0 < sum(seen) < 0.01 * logits.numel()


def test_non_finite_rows_keep_the_full_scores_rules(search: str) -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(5))
    logits[0, 17] = float("nan")
    logits[1, 40] = float("inf")
    logits[2, :] = float("-inf")
    logits[3, :150] = float("-inf")
    seeds, steps = torch.arange(5), torch.arange(5)
    tokens, _ = sample(logits, SamplingParams(), seeds, steps)
    assert tokens.tolist()[:3] == [17, 40, 0]
    assert torch.equal(tokens[3:], scores(logits, SamplingParams(), seeds, steps)[3:].argmax(-1))


@pytest.mark.parametrize("vocab", [4999, 49152])
@pytest.mark.parametrize("offset", [0.0, -3000.0, 5000.0])
def test_compiled_search_keeps_every_token_that_beats_the_top_logits_score(vocab: int, offset: float) -> None:
    """The compiled search's claim itself, wider than "the winner is found": every token whose exact score reaches
    the score of the row's top logit is a candidate. Flat rows make hundreds of them; a vocabulary that is not a
    multiple of 8 exercises the search's padded last word."""
    from models import gumbel_cpu

    gen = torch.Generator().manual_seed(vocab + int(offset))
    for scale in (0.05, 0.5, 2.0, 5.0):
        logits = torch.randn(16, vocab, generator=gen) * scale + offset
        seeds, steps = torch.arange(16) * 7907 + int(scale * 100), torch.arange(16) % 3
        full = scores(logits, SamplingParams(), seeds, steps)
        top = logits.argmax(-1)
        reach = full >= full.gather(-1, top[:, None])
        found = gumbel_cpu.candidates(logits, *sampling._keys(seeds, steps))
        assert found is not None
        kept = torch.zeros_like(reach)
        kept[found] = True
        assert bool(reach.any(-1).all())
        missed = reach & ~kept
        assert not bool(missed.any()), f"scale {scale}: dropped {missed.nonzero().tolist()[:5]}"
        if scale >= 2.0:  # and it prunes: a peaked row keeps a few dozen tokens, not its vocabulary
            assert int(kept.sum()) < 0.01 * kept.numel()


def test_sampling_on_a_cpu_takes_the_compiled_search_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: the compiled search from one SmolLM2 row's worth of logits up, torch below (a toy model's process
    never loads numba); ``compiled`` / ``torch`` force one; top-k/top-p rows take the torch search for few logits;
    an unknown value is an error that names the choices."""
    from models import gumbel_cpu

    calls: list[int] = []
    real = gumbel_cpu.candidates

    def counted(processed: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> object:
        calls.append(processed.shape[0])
        return real(processed, k1, k2)

    monkeypatch.setattr(gumbel_cpu, "candidates", counted)
    monkeypatch.delenv("PRIME_SAMPLER", raising=False)
    gen = torch.Generator().manual_seed(9)
    big = torch.randn(2, sampling.COMPILED_MIN_LOGITS // 2, generator=gen)
    small = torch.randn(3, 1000, generator=gen)
    seeds, steps = torch.arange(3), torch.zeros(3, dtype=torch.long)
    compiled, _ = sample(big, SamplingParams(), seeds[:2], steps[:2])
    assert calls == [2]
    sample(small, SamplingParams(), seeds, steps)
    assert calls == [2]
    monkeypatch.setenv("PRIME_SAMPLER", "compiled")
    forced, _ = sample(small, SamplingParams(), seeds, steps)
    sample(small, SamplingParams(top_k=5), seeds, steps)  # top-k/top-p: few finite logits, the torch search
    assert calls == [2, 3]
    monkeypatch.setenv("PRIME_SAMPLER", "torch")
    assert torch.equal(sample(big, SamplingParams(), seeds[:2], steps[:2])[0], compiled)
    assert torch.equal(sample(small, SamplingParams(), seeds, steps)[0], forced)
    assert calls == [2, 3]
    monkeypatch.setenv("PRIME_SAMPLER", "numba")
    with pytest.raises(ValueError, match="auto, compiled, torch"):
        sample(big, SamplingParams(), seeds[:2], steps[:2])


def test_the_compiled_searchs_constants_are_samplings() -> None:
    from models import gumbel_cpu

    assert (gumbel_cpu._GOLD, gumbel_cpu._MUL1, gumbel_cpu._MUL2) == tuple(
        c & M32 for c in (sampling._C_GOLD, sampling._C_MUL1, sampling._C_MUL2))
    assert (gumbel_cpu._GUMBEL_BOUND, gumbel_cpu._REACH_SLACK, gumbel_cpu._LOG_2_23) == (
        GUMBEL_BOUND, sampling._REACH_SLACK, sampling._LOG_2_23)
