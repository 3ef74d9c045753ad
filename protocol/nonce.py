"""Sender-side nonces: a durable, strictly increasing counter per domain, or a random one.

`NonceCounter` hands out `max(last + 1, now in microseconds)`. The durable `last` keeps values
strictly increasing across restarts even if the clock steps back; the clock floor keeps them fresh
even if the counter file is lost (a new container), so a restarted sender never reuses a nonce a
receiver still remembers. Values stay below 2**63 for the next ~290,000 years.

`random_nonce()` (128 random bits) needs no state at all; receivers accept either, since the replay
guard keeps a seen-set rather than a high-water mark.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType

_SCHEMA = "CREATE TABLE IF NOT EXISTS counters (domain TEXT PRIMARY KEY, last INTEGER NOT NULL)"


def random_nonce() -> int:
    """A 128-bit random nonce from the OS's CSPRNG."""
    return secrets.randbits(128)


class NonceCounter:
    """Durable per-domain nonce counter in SQLite; safe across threads and processes."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        if self.path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(_SCHEMA)

    def next(self, domain: str, *, now: float | None = None) -> int:
        """The next nonce for `domain` (already persisted when returned)."""
        floor = int((time.time() if now is None else now) * 1_000_000)
        with self._lock:
            # IMMEDIATE takes the write lock up front, so two processes cannot read the same `last`.
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT last FROM counters WHERE domain = ?", (domain,)).fetchone()
                value = max(floor, int(row[0]) + 1 if row else 0)
                self._conn.execute(
                    "INSERT INTO counters VALUES (?, ?) ON CONFLICT(domain) DO UPDATE SET last = excluded.last",
                    (domain, value),
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return value

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> NonceCounter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
