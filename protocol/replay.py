"""Durable replay protection for a receiver: every (domain, signer, nonce) is accepted at most once.

The guard keeps the set of nonces seen per (domain, signer) in SQLite (WAL), each with the time
after which the message it came from is too old to be accepted anyway (`open_envelope` rejects it
with `ExpiredError`). Past that time the entry is useless and is pruned, so the table holds only
the messages of the last age window: growth is bounded by traffic per window, not by uptime.

A seen-set (rather than a per-sender high-water mark) lets one sender have several messages in
flight that arrive out of order, and lets senders use random nonces.

The insert is the check: the primary key makes "check and record" one atomic statement, across
threads (one connection behind a lock) and across processes sharing the file (SQLite locking).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType

from protocol.errors import ReplayError

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (
    domain TEXT NOT NULL,
    signer TEXT NOT NULL,
    nonce TEXT NOT NULL,         -- decimal text: nonces may exceed SQLite's 64-bit integers
    expires_at REAL NOT NULL,    -- unix seconds after which the message is expired anyway
    PRIMARY KEY (domain, signer, nonce)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_expiry ON seen (expires_at);
"""


class ReplayGuard:
    """Durable (domain, signer, nonce) seen-set. `path` may be `":memory:"` for a throwaway guard."""

    def __init__(self, path: str | Path, *, prune_every: int = 1000, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._prune_every = prune_every
        self._inserts = 0
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        if self.path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, expires_at: float, now: float | None = None
    ) -> None:
        """Record the nonce, or raise `ReplayError` if it is already recorded and not yet expired."""
        now_s = time.time() if now is None else now
        key = (domain, signer, str(nonce))
        with self._lock:
            try:
                self._conn.execute("INSERT INTO seen VALUES (?, ?, ?, ?)", (*key, expires_at))
            except sqlite3.IntegrityError:
                # An entry past its expiry would have been pruned; treat it the same as a pruned one,
                # so the outcome never depends on when pruning last ran.
                cur = self._conn.execute(
                    "UPDATE seen SET expires_at = ? WHERE domain = ? AND signer = ? AND nonce = ?"
                    " AND expires_at < ?",
                    (expires_at, *key, now_s),
                )
                if cur.rowcount != 1:
                    raise ReplayError(f"nonce {nonce} from {signer} already used in {domain!r}") from None
            self._inserts += 1
            if self._inserts % self._prune_every == 0:
                self._prune_locked(now_s)

    def prune(self, now: float | None = None) -> int:
        """Drop entries whose messages have expired; returns how many."""
        with self._lock:
            return self._prune_locked(time.time() if now is None else now)

    def _prune_locked(self, now_s: float) -> int:
        removed = self._conn.execute("DELETE FROM seen WHERE expires_at < ?", (now_s,)).rowcount
        if removed:
            log.debug("replay guard pruned %d expired nonces", removed)
        return int(removed)

    def __len__(self) -> int:
        with self._lock:
            row = self._conn.execute("SELECT COUNT(*) FROM seen").fetchone()
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ReplayGuard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
