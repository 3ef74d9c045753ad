"""Token buckets: rate, burst, bounded keys."""

from __future__ import annotations

from discovery.ratelimit import Buckets


def test_burst_then_rate() -> None:
    b = Buckets(rate=2.0, burst=3)
    assert [b.take("k", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take("k", now=0.5)  # one token back after half a second
    assert not b.take("k", now=0.5)
    assert b.take("other", now=0.5)  # keys are independent


def test_keys_are_bounded() -> None:
    b = Buckets(rate=1e-9, burst=1, max_keys=2)
    assert b.take("a", now=0.0) and b.take("b", now=0.0) and b.take("c", now=0.0)
    assert len(b) == 2
    assert not b.take("c", now=0.0)  # still remembered
    assert b.take("a", now=0.0)  # forgotten first (least recently used): comes back full
