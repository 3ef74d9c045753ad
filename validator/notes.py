"""This validator's pool notes (`protocol.pool_notes`): what it knows about nodes, signed for its peers.

Built from cheap reads of the ledger (the pending hard rows, the `counter_holes` of the holes window, the
`node_ties` accounts kept row by row), at most every `pool_notes.cache_s`, one build at a time; requests in between
get the same signed bytes. Bounded by `protocol.pool_notes.MAX_NODES` (and `pool_notes.max_nodes`): nodes with a
pending hard verdict come first, then nodes with holes (most first), then the most near-ties; the rest are counted
in `dropped`. `validator.poolview` reads the peers' documents.

`NotesPusher` sends the document to every identified peer (`POST /v1/peer/notes`) as soon as a hard verdict is
pending here that the peers were not sent, so a node held here is held at the peers one round trip later, not
at their next fetch (`pool_notes.interval_s`, plus our `cache_s`). A push that fails is logged and counted and
changes nothing else: the peers' fetches stay the path that always runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.deadline import bounded_request, deadline_client
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.nonce import random_nonce
from protocol.pool_notes import MAX_VERSIONS, MAX_WORK_KEYS, PATH, NodeNote, PoolNotes, VersionHoles
from protocol.upload import upload_headers
from validator.ledger import Ledger
from validator.stats import Stats

log = logging.getLogger(__name__)

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

    def sealed(self, *, rebuild: bool = False) -> bytes:
        """The signed document's bytes, rebuilt when older than `cache_s` (or now, with `rebuild`)."""
        with self._lock:  # one build at a time; those queued behind it take its result
            now = time.monotonic()
            if rebuild or self._sealed is None or now - self._sealed[0] >= self.cache_s:
                envelope = seal(self.identity, self.build(), domain=self.domain, nonce=random_nonce())
                self._sealed = (now, envelope.to_bytes())
            return self._sealed[1]


class NotesPusher:
    """Sends our notes to the peers when a hard verdict is pending here that they were not sent (module docstring)."""

    def __init__(self, notes: Notes, *, peers: Callable[[], dict[str, str]], timeout_s: float, stats: Stats) -> None:
        self.notes, self._peers, self.timeout_s, self.stats = notes, peers, timeout_s, stats
        self._sent: set[str] = set()
        """The pending hard work keys as of the last push (a key is sent once while it stays pending)."""
        self._http = deadline_client(timeout_s)

    def check(self, now: float | None = None) -> int:
        """Push when a pending hard verdict is new since the last push; returns to how many peers it went."""
        t = time.time() if now is None else now
        pending = {key for _, _, _, keys in self.notes.ledger.hard_pending_nodes(
            reported_since=t - self.notes.read_back_s, limit=self.notes.max_nodes, keys_per_node=MAX_WORK_KEYS)
            for key in keys}
        new = pending - self._sent
        self._sent = pending
        if not new:
            return 0
        data = self.notes.sealed(rebuild=True)
        sent = 0
        for address, url in self._peers().items():
            headers = upload_headers(self.notes.identity, data, domain=self.notes.domain, validator=address, path=PATH)
            try:
                r = bounded_request(self._http, "POST", url.rstrip("/") + PATH, self.timeout_s, content=data,
                                    headers={"content-type": "application/json", **headers})
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            except Exception as exc:  # noqa: BLE001 - any failure is that peer's; its next fetch catches up
                self.stats.count("pool_notes_push_failed")
                log.warning("pool notes (%d new hard verdicts) not pushed to %s (%s): %s; it reads them at its "
                            "next fetch", len(new), address, url, exc)
                continue
            sent += 1
            self.stats.count("pool_notes_pushed")
        return sent

    def close(self) -> None:
        self._http.close()
