"""This validator's pool notes (`protocol.pool_notes`): what it knows about nodes, signed for its peers.

Built from cheap reads of the ledger (the pending hard rows, the `counter_holes` of the holes window, the
`node_ties` accounts kept row by row), at most every `pool_notes.cache_s`, one build at a time; requests in between
get the same signed bytes. Bounded by `protocol.pool_notes.MAX_NODES` (and `pool_notes.max_nodes`): nodes with a
pending hard verdict come first, then nodes with holes (most first), then the most near-ties; the rest are counted
in `dropped`. `validator.poolview` reads the peers' documents.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.pool_notes import MAX_VERSIONS, MAX_WORK_KEYS, NodeNote, PoolNotes, VersionHoles
from validator.ledger import Ledger

if TYPE_CHECKING:
    from validator.config import ValidatorConfig


class Notes:
    """Builds and signs this validator's notes (`GET /v1/peer/notes`)."""

    def __init__(self, cfg: ValidatorConfig, identity: Identity, ledger: Ledger, *,
                 current_version: Callable[[], int | None], domain: str) -> None:
        self.identity, self.ledger, self.current_version, self.domain = identity, ledger, current_version, domain
        self.cache_s, self.max_nodes = cfg.pool_notes.cache_s, cfg.pool_notes.max_nodes
        self.holes_window = cfg.flood.holes_window
        self.read_back_s = 2 * cfg.chain.poll_s + 1.0  # as `Admission`: a landed slash is read back by then
        self._lock = threading.Lock()
        self._sealed: tuple[float, bytes] | None = None

    def build(self, now: float | None = None) -> PoolNotes:
        """The document as the ledger stands (see the module docstring for what goes in and what is dropped)."""
        t = time.time() if now is None else now
        current = self.current_version()
        since = 0 if current is None else max(0, current - self.holes_window + 1)
        pending = {node: (n, oldest, keys) for node, n, oldest, keys in self.ledger.hard_pending_nodes(
            reported_since=t - self.read_back_s, limit=self.max_nodes, keys_per_node=MAX_WORK_KEYS)}
        holes = self.ledger.holes_of_nodes(since)
        ties = self.ledger.near_tie_accounts(self.max_nodes)
        order = list(pending) + sorted((n for n in holes if n not in pending), key=lambda n: -sum(holes[n].values()))
        listed = set(order)
        order += [n for n in ties if n not in listed]
        everyone = len(set(order)) + max(0, self.ledger.near_tie_nodes() - len(ties))
        notes = []
        for node in order[:self.max_nodes]:
            n, oldest, keys = pending.get(node, (0, None, []))
            tokens, near, eos = ties[node] if node in ties else self.ledger.near_tie_account(node)
            versions = sorted(holes.get(node, {}).items())[-MAX_VERSIONS:]
            notes.append(NodeNote(
                node=node, hard_pending=n, hard_oldest_ms=None if oldest is None else int(oldest * 1000),
                hard_work_keys=tuple(bytes.fromhex(k[2:]) for k in keys),
                holes=tuple(VersionHoles(policy_version=v, holes=h) for v, h in versions),
                tokens=tokens, near_ties=near, eos_near_ties=eos))
        return PoolNotes(current_version=current, nodes=tuple(notes), dropped=everyone - len(notes))

    def cached(self) -> bytes | None:
        """The signed bytes while younger than `cache_s` (no lock, no ledger read: the HTTP route answers these in
        its event loop), else None."""
        sealed = self._sealed
        return sealed[1] if sealed is not None and time.monotonic() - sealed[0] < self.cache_s else None

    def sealed(self) -> bytes:
        """The signed document's bytes, rebuilt when older than `cache_s`."""
        with self._lock:  # one build at a time; those queued behind it take its result
            now = time.monotonic()
            if self._sealed is None or now - self._sealed[0] >= self.cache_s:
                envelope = seal(self.identity, self.build(), domain=self.domain, nonce=random_nonce())
                self._sealed = (now, envelope.to_bytes())
            return self._sealed[1]
