"""The sampling replay and the termination measurements, on synthetic logits."""

from __future__ import annotations

import math

import pytest
import torch

from models.sampling import SamplingParams, sample
from protocol.errors import ProtocolError
from toploc import ToplocThresholds, check_sampling, check_termination

V = 300
SEED = 123456789


def _logits(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int = SEED) -> list[int]:
    n = logits.shape[0]
    tokens, _ = sample(logits, params, torch.full((n,), seed), torch.arange(n))
    return [int(t) for t in tokens]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.3, top_p=0.9),
     SamplingParams(temperature=0.0)],
)
def test_honest_draws_replay_with_zero_margin(params: SamplingParams) -> None:
    logits = _logits(40)
    tokens = _draw(logits, params)
    check = check_sampling(logits, tokens, params, SEED, tolerance=0.5)
    assert check.mismatch_positions == () and check.max_margin == 0.0
    assert list(check.winners) == tokens
    # Float noise between the node's and the validator's logits stays far inside the tolerance.
    noisy = logits + 1e-3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    assert check_sampling(noisy, tokens, params, SEED, tolerance=0.5).mismatch_positions == ()


def test_changed_tokens_wrong_seed_and_masked_tokens_are_found() -> None:
    params = SamplingParams(temperature=1.0, top_k=10)
    logits = _logits(40)
    tokens = _draw(logits, params)
    changed = list(tokens)
    changed[7] = int(logits[7].argsort()[0])  # the least likely token: outside the top-k set
    check = check_sampling(logits, changed, params, SEED, tolerance=0.5)
    assert check.mismatch_positions == (7,) and math.isinf(check.margins[7])
    wrong_seed = check_sampling(logits, tokens, params, SEED + 1, tolerance=0.5)
    assert len(wrong_seed.mismatch_positions) > 10
    shifted = check_sampling(logits, tokens, params, SEED, tolerance=0.5, first_step=1)
    assert len(shifted.mismatch_positions) > 10
    assert ToplocThresholds().sampling_failed(check)


def test_bad_inputs_raise_protocol_error() -> None:
    logits = _logits(4)
    params = SamplingParams()
    for tokens in ([1, 2, 3], [1, 2, 3, V], [1, 2, 3, -1], [1, 2, 3, 1.5], torch.zeros(4)):
        with pytest.raises(ProtocolError):
            check_sampling(logits, tokens, params, SEED, tolerance=0.5)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        check_sampling(logits[0], [1], params, SEED, tolerance=0.5)
    with pytest.raises(ProtocolError):
        check_sampling(logits, [1, 2, 3, 4], params, -1, tolerance=0.5)


def test_termination_measurements() -> None:
    eos = [2]
    ok_eos = check_termination([5, 6, 2], eos, 10)
    assert ok_eos.ends_with_eos and ok_eos.violations == ()
    ok_len = check_termination([5] * 10, eos, 10)
    assert ok_len.violations == ()
    assert check_termination([5, 2, 6, 2], eos, 10).eos_before_end == (1,)
    assert check_termination([5, 6], eos, 10).violations == ("stopped_early",)
    assert check_termination([5] * 11, eos, 10).violations == ("over_limit",)
    with pytest.raises(ProtocolError):
        check_termination([5], [], 10)


def test_missed_eos_is_reported_where_eos_wins_the_draw() -> None:
    params = SamplingParams(temperature=1.0)
    logits = _logits(12)
    logits[5, 2] = 100.0  # EOS (id 2) wins position 5 by a mile
    tokens = _draw(logits, params)
    assert tokens[5] == 2
    tokens[5] = 9  # the node kept going
    s = check_sampling(logits, tokens, params, SEED, tolerance=0.5)
    t = check_termination(tokens, [2], 12, s)
    assert t.missed_eos == (5,) and "missed_eos" in t.violations


@pytest.mark.parametrize("top_k", [0, 50])  # 0: dense replay; 50: noise only where a token can win
@pytest.mark.parametrize("scale", [0.2, 3.0, 30.0])
def test_replay_margins_equal_the_dense_scores(scale: float, top_k: int) -> None:
    from models.sampling import scores

    params = SamplingParams(temperature=0.8, top_k=top_k)
    logits = _logits(64, seed=3, scale=scale)
    tokens = [int(t) for t in torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(4))]
    tokens[:10] = _draw(logits, params)[:10]
    check = check_sampling(logits, tokens, params, SEED, tolerance=0.5)
    dense = scores(logits, params, torch.full((64,), SEED), torch.arange(64))
    best, arg = dense.max(dim=-1)
    expected = (best.double() - dense[torch.arange(64), torch.tensor(tokens)].double()).tolist()
    assert list(check.margins) == expected
    assert list(check.winners) == arg.tolist()


def test_an_eos_that_won_narrowly_and_was_skipped_is_an_eos_near_tie_and_ends_the_paid_tokens() -> None:
    from models.sampling import scores

    params = SamplingParams(temperature=1.0)
    logits = _logits(12, seed=7)
    row = scores(logits[5:6], params, torch.full((1,), SEED), torch.tensor([5]))[0]
    others = row.clone()
    others[2] = float("-inf")
    second = int(others.argmax())  # the best token that is not EOS
    # make EOS (id 2) win position 5 by 0.2 over the runner-up: a near-tie, not a mismatch
    logits[5, 2] += float(row[second] - row[2]) + 0.2
    tokens = _draw(logits, params)
    assert tokens[5] == 2
    honest = check_sampling(logits[:6], tokens[:6], params, SEED, tolerance=0.5)
    t = check_termination(tokens[:6], [2], 12, honest)
    assert (t.eos_near_ties, t.replay_end, honest.near_ties, t.violations) == ((), 6, (), ())
    tokens[5] = second  # the node skipped the narrow EOS and kept going
    s = check_sampling(logits, tokens, params, SEED, tolerance=0.5)
    t = check_termination(tokens, [2], 12, s)
    assert s.mismatch_positions == () and 5 in s.near_ties
    assert t.eos_near_ties == (5,) and t.missed_eos == () and t.violations == ()
    assert abs(s.margins[5] - 0.2) < 1e-4
    assert t.replay_end == 6  # tokens after the replay's EOS are never paid
