"""Who was assigned what: work keys, tasks, sampling seeds, which validator checks a node's work, and counter order.

Everything here is derived from public inputs the node computes the same way (`protocol.seeds`), bound to this
validator's run, pool and chain (docs/protocol/assignment.md). Counter order is the one stateful rule: for
(node, version) a validator takes counters in order, within a small gap, and counts the ones a node skipped
once the version has left the async window.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from environments import Environment, render_prompt
from environments import get as get_environment
from protocol.episodes import AnySubmission
from protocol.errors import ProtocolError
from protocol.rollout import RunSpec
from protocol.seeds import env_seed, sampling_seed, task_seed, validator_ranking, work_key

if TYPE_CHECKING:
    from environments import Task
    from models.loading import LoadedModel
    from validator.chainview import ChainView
    from validator.ledger import Ledger
    from validator.peers import PeerWatch
    from validator.stats import Stats

log = logging.getLogger(__name__)

_FRONTIERS_KEPT = 4096
"""(node, version) chain frontiers cached before those of stale versions are dropped."""


class CounterOutOfOrderError(ProtocolError):
    """The counter is not the one this validator expects next for (node, version) (nor within the gap).

    Soft and without a ledger row, so the assignment stays free: a node resends its work in counter
    order. Never a slash: that a counter was skipped rests on what this validator did *not* receive,
    which it cannot prove to anyone (docs/protocol/assignment.md, "Counters"; skipped counters are counted instead)."""

    code = "counter_out_of_order"

    def __init__(self, message: str, expected: int) -> None:
        super().__init__(message)
        self.expected = expected


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


class Assignment:
    """The assignment rules of one validator's run (`run`), pool and chain."""

    def __init__(self, run: RunSpec, *, chain_id: int, pool: str, me: str, validators: list[str], ledger: Ledger,
                 chain: ChainView, stats: Stats, counter_gap: int, peers: PeerWatch | None = None) -> None:
        self.run, self.chain_id, self.pool, self.me = run, chain_id, pool, me
        self._validators = validators or [me]
        self.ledger, self.chain, self.stats, self.peers = ledger, chain, stats, peers
        self.counter_gap = counter_gap
        self.env: Environment = get_environment(run.env, run.env_version)
        """The run's environment: tasks come from it, and the checker grades with it."""
        self._holes_below = 0  # versions below this have had their skipped counters counted
        self._frontier: dict[tuple[str, int], int] = {}  # (node, version) -> chain frontier last read (it only grows)

    def validators(self) -> list[str]:
        """The validators announced for the run (this one alone when none are configured)."""
        return self._validators

    def tasks(self, node: str, version: int, counter: int) -> list[Task]:
        manifest = self.chain.manifest_hash(version)
        if manifest is None:
            raise ProtocolError(f"v{version} is not published on chain: its tasks are not drawn yet")
        seed = task_seed(node, version, counter, run_id=self.run.run_id, chain_id=self.chain_id, pool=self.pool,
                         manifest_hash=manifest)
        return self.env.sample(seed, self.run.tasks_per_batch)

    def work_key(self, node: str, version: int, counter: int) -> bytes:
        """`protocol.seeds.work_key` of an assignment in this validator's run, pool and chain."""
        return work_key(self.run.run_id, node, version, counter, chain_id=self.chain_id, pool=self.pool)

    def sampling_seed(self, sub: AnySubmission, task_id: str, sample: int) -> int:
        """The seed of sample `sample` of task `task_id` in `sub`'s assignment, at the manifest hash `sub` names
        (the cheap checks have matched it against the one the chain records for its version before any replay)."""
        return sampling_seed(sub.node, sub.policy_version, task_id, sample, run_id=self.run.run_id,
                             chain_id=self.chain_id, pool=self.pool, counter=sub.counter,
                             manifest_hash=sub.manifest_hash)

    def env_seed(self, sub: AnySubmission, task_id: str) -> int:
        """The seed task `task_id`'s multi-turn environment plays from in `sub`'s assignment."""
        return env_seed(sub.node, sub.policy_version, task_id, run_id=self.run.run_id, chain_id=self.chain_id,
                        pool=self.pool, counter=sub.counter, manifest_hash=sub.manifest_hash)

    def first(self, node: str, version: int) -> str:
        """The rendezvous-first validator of (node, version): the one assigned when everyone is up."""
        return validator_ranking(self.run.run_id, node, version, self.validators())[0]

    def taker(self, node: str, version: int) -> str:
        """The validator that takes `node`'s work at `version`: the first in rendezvous order that is not
        down as seen from here (see `validator.peers`)."""
        for address in validator_ranking(self.run.run_id, node, version, self.validators()):
            if address == self.me or self.peers is None or not self.peers.down(address):
                return address
        return self.me  # pragma: no cover - the loop returns at our own address at the latest

    def counter_base(self, node: str, version: int) -> int | None:
        """Where counter order starts for (node, version) here, read before the submission spends its nonce: 0 at
        the rendezvous-first validator, the chain's frontier (`chain_frontier`) at one covering for it, None where
        no counter is checked here (another validator takes it, or the version is not on chain). `ChainError` if
        the chain cannot be read: our failure, which intake answers with a retry, never a verdict."""
        if self.first(node, version) == self.me:
            return 0
        if self.taker(node, version) != self.me or self.chain.manifest_hash(version) is None:
            return None
        return self.chain_frontier(node, version)

    def counter_problem(self, sub: AnySubmission, base: int | None = None) -> CounterOutOfOrderError | None:
        """Counters in order, with a small bounded gap (docs/protocol/assignment.md, "Counters"): for (node,
        version) let m be the smallest counter this validator holds no row for, counting from 0 where it is the
        assigned (rendezvous-first) validator; `sub.counter` must be in [m, m + counter_gap]. A validator that took the
        node over (the first one down) continues from what the pool knows, never from a counter the node picks: m
        counts from `chain_frontier` (the smallest counter whose work key the chain has not seen). So a
        node cannot search counters for tasks it likes (the next one is fixed) nor hold back a batch that scored
        badly: until that counter arrives, nothing beyond the gap is taken at that version, and `count_holes`
        counts it against the node once the version is stale. `base` is `counter_base`'s answer when the caller
        read it already; `ChainError` if it must be read and the chain cannot be."""
        if base is None:
            base = 0 if self.first(sub.node, sub.policy_version) == self.me else \
                self.chain_frontier(sub.node, sub.policy_version)
        expected = self.ledger.next_counter(sub.node, sub.policy_version, base=base)
        gap = self.counter_gap
        if expected is None or expected <= sub.counter <= expected + gap:
            return None
        if sub.counter < expected and self.ledger.get(_hex(self.work_key(sub.node, sub.policy_version,
                                                                         sub.counter))) is not None:
            return None  # a concurrent request took this assignment first: a retry or equivocation, not order
        return CounterOutOfOrderError(
            f"counter {sub.counter} at v{sub.policy_version}: this validator takes counter {expected} next (at most "
            f"{gap} ahead); send the assignments in counter order", expected)

    def chain_frontier(self, node: str, version: int) -> int:
        """The smallest counter of (node, version) whose work key the pool has not seen (recorded or invalidated):
        where a covering validator continues the node's sequence. Work the down peer took but has not reported
        yet is not on chain, so the node may be told an earlier counter (soft, no row) until it is; that costs
        the node a wait, never a counter of its choosing. `ChainError` if the chain cannot be read."""
        counter = self._frontier.get((node, version), 0)
        while self.chain.work_known(self.work_key(node, version, counter)):
            counter += 1
        if len(self._frontier) >= _FRONTIERS_KEPT:  # forget versions outside the async window (never asked again)
            current = self.chain.current_version() or 0
            self._frontier = {k: v for k, v in self._frontier.items() if k[1] >= current - self.run.async_level}
        self._frontier[(node, version)] = counter
        return counter

    def count_holes(self) -> int:
        """Count, once per (node, version) that left the async window, the counters the node skipped here
        (between the first counter it had to send and the last one it sent; docs/protocol/assignment.md,
        "Counters"); returns how many (node, version)s were counted. Holes cost reputation, not stake: they are in the
        ledger (`/v1/audit` `counter_holes`, `/v1/nodes/<node>`) and the metrics (`counter_holes`), and
        at the version itself they already cost the node every assignment after the gap."""
        current = self.chain.current_version()
        if current is None:
            return 0
        below = current - self.run.async_level
        if below <= self._holes_below:
            return 0
        counted = 0
        for node, version, lo, hi, n in self.ledger.uncounted_assignments(below, self._holes_below):
            base = 0 if self.first(node, version) == self.me else lo
            holes = max(0, hi - base + 1 - n)
            if self.ledger.record_holes(node, version, base, hi, holes):
                counted += 1
                if holes:
                    self.stats.count("counter_holes", holes)
                    log.warning("node %s skipped %d of counters %d..%d at v%d (never sent here)", node, holes, base,
                                hi, version)
        self._holes_below = below
        return counted


def prompt_tokens(loaded: LoadedModel, task: Task) -> list[int]:
    """The task's prompt as the run's tokenizer renders it (what the node's sample continues)."""
    ids = render_prompt(loaded.tokenizer, task, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]
