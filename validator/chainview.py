"""What the validator believes about the chain: which nodes may submit, and which policy versions exist.

Read once from the pool's events since its deployment block, then kept fresh by polling new events
(`refresh`, called by a background thread every `poll_s`). A node's record is re-read only when an
event names it, so a submission never costs an RPC of its own: a signer we do not (yet) see as active
makes us catch up with the chain's events, at most once per `CATCHUP_S` (`node_active_fresh`), so a node
that registered just before its first submission is not refused for our poll's timing. A "no" is final only from a
view read after the request arrived; within `CATCHUP_S` of the last catch-up the answer is "not known yet" (None),
which intake answers 503 `chain_unavailable` + Retry-After, never 403. The chain is authoritative for policy versions:
`PolicyPublished(version, manifestHash)` is what a submission's manifest hash must match.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from contracts.events import reread_from
from contracts.pool import NodeStatus, PoolClient
from protocol.errors import ChainError
from protocol.identity import checksum

log = logging.getLogger(__name__)

CATCHUP_S = 0.5
"""The shortest time between two catch-ups that signers we do not see as active can cause."""

_NODE_EVENTS = {"NodeRegistered", "StakeAdded", "LeaveStarted", "StakeWithdrawn", "StakeSlashed", "NodeEjected",
                "SlashReversed", "NodeReinstated"}


@dataclass(frozen=True)
class NodeView:
    status: NodeStatus
    stake: int


class ChainView:
    """Cached node states and policy versions of one pool (see the module docstring)."""

    def __init__(self, pool: PoolClient, start_block: int) -> None:
        self.pool = pool
        self._start_block = start_block
        self._next_block = start_block
        self._nodes: dict[str, NodeView] = {}
        self._manifests: dict[int, bytes] = {}
        self._operators: set[str] = set()
        """The operators of every node ever registered (an appeal may be signed by one)."""
        self._lock = threading.Lock()
        self.min_stake = 0
        self.invalidation_window: int | None = None
        """The pool's invalidation window in seconds (None until the first refresh)."""
        self.unbonding_period: int | None = None
        """The pool's unbonding period in seconds (None until the first refresh)."""
        self.last_error: str | None = None
        self.refreshed_at = -float("inf")
        """time.monotonic() of the last successful refresh."""
        self.read_since = -float("inf")
        """time.monotonic() when the newest successful refresh began: the view holds every event mined before it."""
        self._refresh_lock = threading.Lock()
        self._catchup_lock = threading.Lock()
        self._catchup_at = -float("inf")
        self.catchups = 0
        """How many times an unknown signer made us read the chain before the poll (bounded by the interval)."""

    def refresh(self) -> int:
        """Read events since the last refresh; returns how many were applied. `ChainError` if unreachable."""
        began = time.monotonic()
        params = self.pool.params()
        latest = int(self.pool.tx.rpc("block number", lambda: self.pool.w3.eth.block_number))
        cursor = self._next_block
        start = reread_from(cursor, latest, self._start_block)  # a rollback's re-sent events too
        if latest < start:
            self._read(began)
            return 0
        events = self.pool.events(start, latest, names=_NODE_EVENTS | {"PolicyPublished"})
        touched: set[str] = set()
        manifests: dict[int, bytes] = {}
        for ev in events:
            if ev.name == "PolicyPublished":
                manifests[int(ev.args["version"])] = bytes(ev.args["manifestHash"])
            else:
                touched.add(checksum(str(ev.args["node"])))
        fresh, operators = {}, set()
        for node in touched:
            info = self.pool.get_node(node)
            fresh[node] = NodeView(info.status, info.stake)
            operators.add(checksum(info.operator))
        with self._lock:
            self.min_stake = params.min_stake
            self.invalidation_window = params.invalidation_window
            self.unbonding_period = params.unbonding_period
            self._nodes.update(fresh)
            self._operators |= operators
            self._manifests.update(manifests)
            self._next_block = latest + 1
        new = sum(1 for ev in events if ev.block_number >= cursor)  # not the blocks read again
        if new:
            log.info("chain: %d events up to block %d (%d nodes refreshed, versions %s)", new, latest,
                     len(fresh), sorted(manifests) or "-")
        self._read(began)
        return new

    def _read(self, began: float) -> None:
        with self._lock:
            self.read_since = max(self.read_since, began)
        self.refreshed_at = time.monotonic()

    def try_refresh(self) -> None:
        """`refresh`, one at a time (the poll thread and intake's catch-up), logging a failure instead of raising."""
        try:
            with self._refresh_lock:
                self.refresh()
            self.last_error = None
        except ChainError as exc:
            self.last_error = str(exc)
            log.warning("chain refresh failed (will retry): %s", exc)

    def node_active(self, node: str) -> bool:
        """Registered, active and staked at least the pool's minimum (as of the last refresh)."""
        with self._lock:
            view = self._nodes.get(checksum(node))
            return view is not None and view.status == NodeStatus.ACTIVE and view.stake >= self.min_stake

    def node_active_fresh(self, node: str, min_interval_s: float, asked_at: float | None = None) -> bool | None:
        """`node_active`, but when the answer is no, first catch up with the chain's new events (a node that
        registered a moment ago must not be refused because our poll had not come round yet). Catch-ups are one
        event read whoever asks, at most one per `min_interval_s`, so unknown signers cannot turn submissions
        into RPC calls. None: not known yet (see `fresh`)."""
        return self.fresh(self.node_active, node, min_interval_s, asked_at)

    def fresh(self, check: Callable[[str], bool], address: str, min_interval_s: float,
              asked_at: float | None = None) -> bool | None:
        """`check(address)`, asked again after a catch-up with the chain when it says no (see `node_active_fresh`).

        A no counts only from a view read after `asked_at` (time.monotonic() when the request arrived; now by
        default): a node that registered before it asked is in such a view. When the last catch-up was less than
        `min_interval_s` ago and read the chain before the request came, or the chain did not answer, the answer is
        None: not known yet; ask again after `retry_after_s`."""
        asked_at = time.monotonic() if asked_at is None else asked_at
        if check(address):
            return True
        if self.read_since < asked_at and time.monotonic() - self._catchup_at >= min_interval_s:
            with self._catchup_lock:  # one catch-up at a time; the others see its result
                if self.read_since < asked_at and time.monotonic() - self._catchup_at >= min_interval_s:
                    self._catchup_at = time.monotonic()  # also when it fails: a dead chain is not asked per request
                    self.catchups += 1
                    self.try_refresh()
        if check(address):
            return True
        return False if self.read_since >= asked_at else None

    def retry_after_s(self, min_interval_s: float) -> float:
        """How long until the next catch-up may run (a `fresh` that said None is worth asking again then)."""
        return max(0.0, self._catchup_at + min_interval_s - time.monotonic())

    def stake(self, node: str) -> int:
        """The node's stake as of the last refresh (0 when unknown)."""
        with self._lock:
            view = self._nodes.get(checksum(node))
            return view.stake if view is not None else 0

    def known(self, node: str) -> bool:
        """Ever registered in this pool (whatever its state now)."""
        with self._lock:
            return checksum(node) in self._nodes

    def known_or_operator(self, address: str) -> bool:
        """A node ever registered in this pool, or the operator of one (who may sign its appeals)."""
        address = checksum(address)
        with self._lock:
            return address in self._nodes or address in self._operators

    def current_version(self) -> int | None:
        """The newest policy version published on chain (None before the first)."""
        with self._lock:
            return max(self._manifests) if self._manifests else None

    def manifest_hash(self, version: int) -> bytes | None:
        with self._lock:
            return self._manifests.get(version)

    def work_known(self, key: bytes) -> bool:
        """Whether the pool has seen work key `key` (recorded or invalidated): read from the chain, not cached,
        since a covering validator continues a node's counters from it (docs/protocol/assignment.md, "Counters").
        `ChainError` if unreachable."""
        return self.pool.get_work(key).known

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._manifests)
