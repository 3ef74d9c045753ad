"""Where a step's samples come from, and the async window that decides which ones are still usable.

A source hands out whole GRPO groups (all samples of one prompt). Step n accepts a group only if every
sample's policy version is in [n - async_level, n]; older ones are stale (dropped and counted, as a
validator would soft-reject them), newer ones cannot exist honestly (dropped and counted as `future`).

A step waits a bounded time (issue 26 item 2): it takes `n_groups` as soon as they are there, and once
`fill_timeout_s` has passed it trains on what it has if that is at least `min_groups`, so a node that died
or left cannot stall training (its share of the step is simply missing). Below `min_groups` it keeps
waiting, up to the source's `wait_timeout_s` (then `DataStarvedError`).

The wait adapts to what arrives (issue 39 item 3): after a step cut short by the fill deadline, the trainer
passes what that step got as `expected`, and the next steps take that many as soon as they are there instead
of waiting out the deadline again for a share that is not coming (`ExpectedGroups`, docs/protocol/run.md).
A step that finds all `n_groups` (the node came back, or the rest arrived while it trained) sets it back.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import ProtocolError, TrainerError
from protocol.rollout_files import Sample, read_rollouts

log = logging.getLogger(__name__)

Group = list[Sample]


class DataStarvedError(TrainerError):
    """The source could not supply enough fresh groups for a step in the allowed time."""

    code = "data_starved"


@dataclass
class WindowCounts:
    """What the async window did for one step (sample counts)."""

    accepted: int = 0
    stale: int = 0
    future: int = 0
    rejected_files: int = 0
    ungradable: int = 0
    """Samples of groups dropped because the environment could not grade one of them (local mode)."""

    def add(self, other: WindowCounts) -> None:
        self.accepted += other.accepted
        self.stale += other.stale
        self.future += other.future
        self.rejected_files += other.rejected_files
        self.ungradable += other.ungradable


def window_verdict(group: Sequence[Sample], step: int, async_level: int) -> str:
    """'ok', 'stale' or 'future' for a group at `step` (the policy version being trained)."""
    versions = [s.policy_version for s in group]
    if min(versions) < step - async_level:
        return "stale"
    if max(versions) > step:
        return "future"
    return "ok"


@dataclass
class Batch:
    """A step's groups plus the window accounting that produced them."""

    groups: list[Group]
    counts: WindowCounts = field(default_factory=WindowCounts)
    work: dict[str, list[str]] = field(default_factory=dict)
    """Work keys this batch consumed, by what became of them (`trained`, `stale`, `future`); only sources
    that know work keys (validators' feeds) fill it. The trainer's work ledger (`work_ledger`) records it."""

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


@dataclass(frozen=True)
class Fill:
    """When a step's wait for groups ends: `n_groups` in hand, or `min_groups` once `fill_deadline` passed."""

    n_groups: int
    min_groups: int
    fill_deadline: float
    """time.monotonic() after which `min_groups` are enough (inf: wait for all `n_groups`)."""
    expected: int | None = None
    """Enough at once (between `min_groups` and `n_groups`): what the last short step got, see `ExpectedGroups`."""

    @classmethod
    def start(cls, n_groups: int, min_groups: int | None, fill_timeout_s: float | None,
              expected: int | None = None) -> Fill:
        low = n_groups if min_groups is None else max(1, min(min_groups, n_groups))
        deadline = float("inf") if fill_timeout_s is None else time.monotonic() + fill_timeout_s
        if expected is not None and fill_timeout_s is not None:  # only a run that allows short steps adapts
            expected = max(low, min(expected, n_groups))
        else:
            expected = None
        return cls(n_groups, low, deadline, expected)

    def done(self, have: int) -> bool:
        return (have >= self.n_groups or (self.expected is not None and have >= self.expected)
                or (have >= self.min_groups and time.monotonic() >= self.fill_deadline))

    def wake_in(self, have: int) -> float:
        """Seconds until `done` could turn true without new groups (inf if only new groups help)."""
        if have < self.min_groups:
            return float("inf")
        return max(0.0, self.fill_deadline - time.monotonic())


class ExpectedGroups:
    """How many groups the next step takes at once, learned from the last step (see the module docstring):
    None (all `n_groups`) until a step is cut short by the fill deadline, then what that step got, until a
    step gets all `n_groups` again."""

    def __init__(self) -> None:
        self.value: int | None = None

    def update(self, got: int, n_groups: int) -> None:
        before, self.value = self.value, (None if got >= n_groups else got)
        if self.value != before:
            if self.value is None:
                log.info("a step got all %d groups: the next ones wait for all of them again", n_groups)
            else:
                log.warning("a step got %d of %d groups: the next ones take %d as soon as they are there "
                            "(a node's share is missing)", got, n_groups, got)


class RolloutSource(ABC):
    """Supplies groups for step n; its position is checkpointed so a resumed run sees the same data."""

    @abstractmethod
    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:
        """`n_groups` groups, all inside the async window of `step` (the local source returns fewer
        when some could not be graded; `counts.ungradable` says how many samples that dropped). Sources
        that wait for the network return as few as `min_groups` (default: all `n_groups`) once they have
        waited `fill_timeout_s` (default: no such bound), or `expected` at once, see `Fill`."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position from `state_dict()`."""

    def close(self) -> None:  # noqa: B027 - optional hook, most sources hold nothing
        """Release resources."""


def split_groups(samples: Sequence[Sample]) -> list[list[int]]:
    """Row indices per group, groups in order of first appearance."""
    order: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        order.setdefault(s.group_id, []).append(i)
    return list(order.values())


class DirectorySource(RolloutSource):
    """Rollout files in a directory, consumed in file-name order; a group lives within one file.

    A malformed file is rejected whole (logged, counted, never retried) instead of stopping training.
    """

    def __init__(
        self,
        path: Path,
        poll_interval_s: float = 0.5,
        wait_timeout_s: float = 600.0,
        vocab_size: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s
        self.wait_timeout_s = wait_timeout_s
        self.vocab_size = vocab_size
        self._consumed: list[str] = []
        self._consumed_set: set[str] = set()
        self._pending: list[tuple[str, list[int]]] = []  # (file, rows) per group, arrival order
        self._cache: dict[str, list[Sample]] = {}

    def _rows(self, name: str) -> list[Sample]:
        if name not in self._cache:
            self._cache[name] = read_rollouts(self.path / name, self.vocab_size)
        return self._cache[name]

    def _scan(self) -> int:
        rejected = 0
        if not self.path.is_dir():
            return 0
        for p in sorted(self.path.glob("*.parquet")):
            if p.name in self._consumed_set:
                continue
            self._consumed.append(p.name)
            self._consumed_set.add(p.name)
            try:
                rows = self._rows(p.name)
            except ProtocolError as exc:  # RolloutError, UnknownVersionError
                log.warning("rejected rollout file %s: %s", p.name, exc)
                rejected += 1
                continue
            self._pending.extend((p.name, idx) for idx in split_groups(rows))
        return rejected

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:
        batch = Batch(groups=[])
        fill = Fill.start(n_groups, min_groups, fill_timeout_s, expected)
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            batch.counts.rejected_files += self._scan()
            while self._pending and len(batch.groups) < n_groups:
                name, idx = self._pending.pop(0)
                group = [self._rows(name)[i] for i in idx]
                verdict = window_verdict(group, step, async_level)
                if verdict == "ok":
                    batch.groups.append(group)
                    batch.counts.accepted += len(group)
                elif verdict == "stale":
                    batch.counts.stale += len(group)
                else:
                    batch.counts.future += len(group)
            if fill.done(len(batch.groups)):
                self._evict()
                return batch
            if time.monotonic() > deadline:
                raise DataStarvedError(
                    f"step {step}: {len(batch.groups)}/{n_groups} fresh groups after {self.wait_timeout_s:.0f} s"
                )
            time.sleep(min(self.poll_interval_s, fill.wake_in(len(batch.groups))))

    def _evict(self) -> None:
        live = {name for name, _ in self._pending}
        for name in list(self._cache):
            if name not in live:
                del self._cache[name]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": list(self._consumed), "pending": [[n, list(i)] for n, i in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._consumed = list(state["consumed"])
        self._consumed_set = set(self._consumed)
        self._pending = [(str(n), [int(x) for x in i]) for n, i in state["pending"]]
        self._cache.clear()
