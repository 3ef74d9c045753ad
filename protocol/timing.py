"""Stage timing: the public hook benchmarks use to break a role's work down by stage.

A component that offers it takes an optional `StageTimer` (`validator.core.Core.timer`, `toploc.validation.measure`'s
`timer=`) and wraps each of its stages in `stage(timer, "label")`. With no timer that is a no-op
(`contextlib.nullcontext`), so production pays one `None` check per stage. Timing is *exclusive*: a stage
nested inside another is charged to its own label only, so the labels add up to the wall time spent inside
timed stages. The labels each component fills are listed in its docstring; they are part of its interface,
and a benchmark reading them breaks loudly (a missing key), never silently, when one is renamed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext


class StageTimer:
    """Exclusive wall seconds and call counts per stage label. Safe to share between threads (each thread
    nests its own stages; the totals are summed under a lock)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        """Exclusive seconds per label."""
        self.calls: dict[str, int] = {}
        """How many times each label's stage ran."""
        self._lock = threading.Lock()
        self._local = threading.local()

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        stack: list[float] = self._local.__dict__.setdefault("stack", [])
        stack.append(0.0)  # seconds of nested stages, charged to them instead of to this one
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            nested = stack.pop()
            if stack:
                stack[-1] += dt
            with self._lock:
                self.times[label] = self.times.get(label, 0.0) + dt - nested
                self.calls[label] = self.calls.get(label, 0) + 1

    def total(self) -> float:
        """Seconds inside timed stages (the sum of the exclusive times)."""
        with self._lock:
            return sum(self.times.values())


def stage(timer: StageTimer | None, label: str) -> AbstractContextManager[None]:
    """`timer.stage(label)`, or a no-op without a timer."""
    return nullcontext() if timer is None else timer.stage(label)
