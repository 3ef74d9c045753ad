"""`validator.near_tie_rule`: k near-tie disagreements in n paid tokens against the honest rate (issue 35 item 5)."""

from __future__ import annotations

import math
import random

import pytest

from validator.near_tie_rule import ALPHA, NearTieRuleError, beyond_honest, log_tail_bound, most_honest

HONEST_RATE = 0.01


def test_alpha_is_a_millionth_per_day_over_the_days_tests() -> None:
    assert ALPHA == pytest.approx(1e-11)


def test_honest_nodes_at_the_honest_rate_are_never_flagged() -> None:
    """Honest accounts drawn at rate p (seeded), tested after every submission of 100 tokens as the validator does,
    up to a million tokens each: no test flags any of them."""
    rng = random.Random(35)
    for _ in range(20):
        n = k = 0
        for _ in range(10_000):
            n += 100
            k += sum(rng.random() < HONEST_RATE for _ in range(100))
            assert not beyond_honest(n, k, HONEST_RATE), (n, k)


def test_a_node_steering_40_percent_of_its_tokens_is_flagged_within_a_few_samples() -> None:
    rng = random.Random(7)
    n = k = 0
    flagged_at = None
    for sample in range(1, 50):
        n += 64
        k += sum(rng.random() < 0.4 for _ in range(64))
        if beyond_honest(n, k, HONEST_RATE):
            flagged_at = sample
            break
    assert flagged_at is not None and flagged_at <= 2, (flagged_at, n, k)


def test_the_bound_is_the_chernoff_tail_and_most_honest_is_the_last_unflagged_count() -> None:
    # at or below the mean nothing is bounded; above it the bound is exp(-n D(k/n || p))
    assert log_tail_bound(1000, 10, HONEST_RATE) == 0.0
    q = 0.05
    want = -1000 * (q * math.log(q / HONEST_RATE) + (1 - q) * math.log((1 - q) / (1 - HONEST_RATE)))
    assert log_tail_bound(1000, 50, HONEST_RATE) == pytest.approx(want)
    for n in (1, 10, 100, 10_000, 1_000_000):
        m = most_honest(n, HONEST_RATE)
        assert not beyond_honest(n, m, HONEST_RATE)
        assert m == n or beyond_honest(n, m + 1, HONEST_RATE)
    # what a steering node can stay under shrinks per token as its account grows
    assert most_honest(10_000_000, HONEST_RATE) / 10_000_000 < most_honest(10_000, HONEST_RATE) / 10_000


@pytest.mark.parametrize(("n", "k", "p"), [(-1, 0, 0.01), (10, 11, 0.01), (10, -1, 0.01), (10, 1, 0.0),
                                           (10, 1, 1.0), (10, 1, math.nan), (10.0, 1, 0.01), (True, 1, 0.01)])
def test_impossible_counts_and_rates_are_typed_errors(n: object, k: object, p: float) -> None:
    with pytest.raises(NearTieRuleError):
        beyond_honest(n, k, p)  # type: ignore[arg-type]
