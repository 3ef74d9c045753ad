"""The validator's counters (`/metrics` exports them as `prime_validator_events{event="<name>"}`), shared by its rooms."""

from __future__ import annotations

import threading


class Stats:
    """Named counters, safe to bump from the HTTP threads and the model thread at once."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def get(self, name: str, default: int | None = None) -> int | None:
        with self._lock:
            return self._counts.get(name, default)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
