"""The policy versions a pool has published, with their manifest hashes, from `PolicyPublished` events.

The contract stores only the newest (version, hash); a node or validator working inside the async
window needs the hash of each version it may use, so it reads the events once from the deployment
block and then only the new blocks (`refresh`).
"""

from __future__ import annotations

import threading

from contracts.pool import PoolClient


class PolicyHistory:
    """{version: manifest hash} of one pool, refreshed incrementally."""

    def __init__(self, pool: PoolClient, start_block: int = 0) -> None:
        self.pool = pool
        self._next_block = start_block
        self._hashes: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def refresh(self) -> list[int]:
        """Read the blocks since the last refresh; returns the versions newly seen. `ChainError` if unreachable."""
        latest = int(self.pool.tx.rpc("block number", lambda: self.pool.w3.eth.block_number))
        with self._lock:
            start = self._next_block
        if latest < start:
            return []
        fresh = {int(ev.args["version"]): bytes(ev.args["manifestHash"])
                 for ev in self.pool.events(start, latest, names={"PolicyPublished"})}
        with self._lock:
            self._hashes.update(fresh)
            self._next_block = max(self._next_block, latest + 1)
        return sorted(fresh)

    def current(self) -> int | None:
        """The newest version published (as of the last refresh), None before the first."""
        with self._lock:
            return max(self._hashes) if self._hashes else None

    def manifest_hash(self, version: int) -> bytes | None:
        with self._lock:
            return self._hashes.get(version)
