"""What the validator believes about the chain: which nodes may submit, and which policy versions exist.

Read once from the pool's events since its deployment block, then kept fresh by polling new events
(`refresh`, called by a background thread every `poll_s`). A node's record is re-read only when an
event names it, so a submission never costs an RPC. The chain is authoritative for policy versions:
`PolicyPublished(version, manifestHash)` is what a submission's manifest hash must match.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from contracts.pool import NodeStatus, PoolClient
from protocol.errors import ChainError
from protocol.identity import checksum

log = logging.getLogger(__name__)

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
        self._next_block = start_block
        self._nodes: dict[str, NodeView] = {}
        self._manifests: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.min_stake = 0
        self.last_error: str | None = None

    def refresh(self) -> int:
        """Read events since the last refresh; returns how many were applied. `ChainError` if unreachable."""
        params = self.pool.params()
        latest = int(self.pool.tx.rpc("block number", lambda: self.pool.w3.eth.block_number))
        if latest < self._next_block:
            return 0
        events = self.pool.events(self._next_block, latest, names=_NODE_EVENTS | {"PolicyPublished"})
        touched: set[str] = set()
        manifests: dict[int, bytes] = {}
        for ev in events:
            if ev.name == "PolicyPublished":
                manifests[int(ev.args["version"])] = bytes(ev.args["manifestHash"])
            else:
                touched.add(checksum(str(ev.args["node"])))
        fresh = {}
        for node in touched:
            info = self.pool.get_node(node)
            fresh[node] = NodeView(info.status, info.stake)
        with self._lock:
            self.min_stake = params.min_stake
            self._nodes.update(fresh)
            self._manifests.update(manifests)
            self._next_block = latest + 1
        if events:
            log.info("chain: %d events up to block %d (%d nodes refreshed, versions %s)", len(events), latest,
                     len(fresh), sorted(manifests) or "-")
        return len(events)

    def try_refresh(self) -> None:
        try:
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

    def known(self, node: str) -> bool:
        """Ever registered in this pool (whatever its state now)."""
        with self._lock:
            return checksum(node) in self._nodes

    def current_version(self) -> int | None:
        """The newest policy version published on chain (None before the first)."""
        with self._lock:
            return max(self._manifests) if self._manifests else None

    def manifest_hash(self, version: int) -> bytes | None:
        with self._lock:
            return self._manifests.get(version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._manifests)
