"""Token buckets per key (a libp2p peer, an Ethereum signer), with a bounded number of keys."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class Buckets:
    """`rate` tokens per second per key, at most `burst` banked; thread-safe.

    At most `max_keys` buckets are kept: the least recently used is forgotten first, so a flood of
    fresh keys costs memory bounded by config (a forgotten key comes back with a full bucket, which
    is the price of the bound; the per-forwarder limit still holds the flood).
    """

    def __init__(self, rate: float, burst: float, *, max_keys: int = 10_000) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("rate must be > 0, burst >= 1, max_keys >= 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str, *, now: float | None = None) -> bool:
        """Spend one token of `key`'s bucket; False (nothing spent) when it is empty."""
        t = time.monotonic() if now is None else now
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, t))
            tokens = min(self.burst, tokens + max(0.0, t - at) * self.rate)
            allowed = tokens >= 1.0
            if allowed:
                tokens -= 1.0
            self._buckets[key] = (tokens, t)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return allowed

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)
