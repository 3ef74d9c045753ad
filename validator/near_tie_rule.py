"""The near-tie rule: does a node's count of near-tie disagreements lie beyond what honest float drift gives?

A near-tie disagreement is a paid token that is not the replay's winner but loses to it by no more than the
sampling tolerance (`toploc.sampling_check`). Each one passes the sampling check; a node choosing among near-ties
on purpose (to steer what the trainer learns) makes them far more often than an honest node, whose near-ties
come only from float drift between its decode and the validator's prefill. `bench/near_ties.py` measures the
honest rate per token `p` for each engine and compute precision; this module says when `k` near-ties in `n` paid
tokens are beyond the honest tail.

The bound (docs/protocol/verdicts.md, "Near-tie steering"). Model an honest node's near-ties as independent
per-token events each of probability at most `p`: their count is then stochastically dominated by Binomial(n, p),
and the Chernoff-Hoeffding bound gives, for k >= n p,

    P[K >= k] <= exp(-n * D(k/n || p)),    D(q || p) = q ln(q/p) + (1-q) ln((1-q)/(1-p)).

The node's account is tested after each of its accepted submissions. With at most `TESTS_PER_NODE_PER_DAY`
tests of one honest node per day, flagging only where the bound is at most `ALPHA` =
`FALSE_POSITIVES_PER_NODE_PER_DAY / TESTS_PER_NODE_PER_DAY` keeps, by the union bound over the day's tests,
the probability of any false verdict against an honest node below `FALSE_POSITIVES_PER_NODE_PER_DAY` per day
(whatever the tests' dependence on each other: the union bound needs none).
"""

from __future__ import annotations

import math

from protocol.errors import ProtocolError

FALSE_POSITIVES_PER_NODE_PER_DAY = 1e-6
"""The goal: the chance that an honest node gets a near-tie verdict on a given day."""
TESTS_PER_NODE_PER_DAY = 100_000
"""Assumed upper bound on how often one node's account is tested in a day: once per accepted submission, and a
node submits at most about once a second (86,400 a day; rounded up)."""
ALPHA = FALSE_POSITIVES_PER_NODE_PER_DAY / TESTS_PER_NODE_PER_DAY
"""The per-test false-positive rate (1e-11): a test flags only where the honest tail bound is at most this."""


class NearTieRuleError(ProtocolError):
    """The rule was asked about impossible counts or a rate outside (0, 1)."""

    code = "near_tie_rule"


def _check(n: int, k: int, p: float, alpha: float) -> None:
    if isinstance(n, bool) or isinstance(k, bool) or not isinstance(n, int) or not isinstance(k, int):
        raise NearTieRuleError(f"token and near-tie counts must be integers, got {n!r} and {k!r}")
    if n < 0 or not 0 <= k <= n:
        raise NearTieRuleError(f"need 0 <= near-ties <= tokens, got {k} near-ties in {n} tokens")
    if not 0.0 < p < 1.0 or not math.isfinite(p):
        raise NearTieRuleError(f"the honest near-tie rate must be in (0, 1), got {p!r}")
    if not 0.0 < alpha < 1.0:
        raise NearTieRuleError(f"the false-positive rate must be in (0, 1), got {alpha!r}")


def _kl(q: float, p: float) -> float:
    """D(q || p) between Bernoulli(q) and Bernoulli(p), 0 < p < 1, 0 <= q <= 1 (0 ln 0 = 0)."""
    out = 0.0
    if q > 0.0:
        out += q * math.log(q / p)
    if q < 1.0:
        out += (1.0 - q) * math.log((1.0 - q) / (1.0 - p))
    return out


def log_tail_bound(n: int, k: int, p: float) -> float:
    """ln of the Chernoff-Hoeffding bound on P[Binomial(n, p) >= k]: -n D(k/n || p) above the mean, else 0."""
    _check(n, k, p, 0.5)
    if n == 0 or k <= n * p:
        return 0.0
    return -n * _kl(k / n, p)


def beyond_honest(n: int, k: int, p: float, alpha: float = ALPHA) -> bool:
    """True when `k` near-tie disagreements in `n` paid tokens are beyond an honest node's tail at honest
    per-token rate `p`: the bound on P[K >= k] is at most `alpha` (see the module docstring)."""
    _check(n, k, p, alpha)
    return log_tail_bound(n, k, p) <= math.log(alpha)


def most_honest(n: int, p: float, alpha: float = ALPHA) -> int:
    """The largest near-tie count in `n` paid tokens that `beyond_honest` does not flag (what a steering node can
    stay under: this minus the honest n p is what it can choose)."""
    _check(n, 0, p, alpha)
    lo, hi = math.floor(n * p), n  # not flagged at or below the mean; find the last count not flagged
    if not beyond_honest(n, hi, p, alpha):
        return n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if beyond_honest(n, mid, p, alpha):
            hi = mid
        else:
            lo = mid
    return lo
