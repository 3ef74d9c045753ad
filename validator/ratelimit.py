"""Token buckets: how fast one sender may go (a staked node at intake, a source address at `/v1/audit`).

A bucket holds up to `burst` tokens and gains `rate` a second; each request takes one, and one that finds none is
told how long until one is there (the Retry-After of a 429). `KeyedBuckets` keeps one bucket per key in bounded
memory: past `max_keys` it forgets the buckets that are full again (forgetting one loses nothing: a new bucket
starts full), then the least recently used. Callers hold their own lock where threads share the buckets.
"""

from __future__ import annotations

import time


class Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at = tokens, at


def take(b: Bucket, rate: float, burst: int, now: float) -> float:
    """Take one token from `b`; 0 when taken, else the seconds until one is there."""
    b.tokens = min(float(burst), b.tokens + (now - b.at) * rate)
    b.at = now
    if b.tokens < 1.0:
        return (1.0 - b.tokens) / rate
    b.tokens -= 1.0
    return 0.0


class KeyedBuckets:
    """One bucket per key, at most `max_keys` of them."""

    def __init__(self, rate: float, burst: int, max_keys: int = 4096) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, Bucket] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, now: float | None = None) -> float:
        """Take one of `key`'s tokens; 0 when taken, else the seconds until one is there."""
        now = time.monotonic() if now is None else now
        b = self._buckets.pop(key, None)
        if b is None:
            b = Bucket(float(self.burst), now)
            if len(self._buckets) >= self.max_keys:
                self._forget(now)
        self._buckets[key] = b  # (re)inserted last: the most recently used
        return take(b, self.rate, self.burst, now)

    def _forget(self, now: float) -> None:
        full_after = self.burst / self.rate
        self._buckets = {k: b for k, b in self._buckets.items() if now - b.at < full_after}
        while len(self._buckets) >= self.max_keys:  # every one still refilling: the least recently used go
            del self._buckets[next(iter(self._buckets))]
