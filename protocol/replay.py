"""Durable replay protection for a receiver: every (domain, signer, nonce) is accepted at most once.

The guard keeps the set of nonces seen per (domain, signer) in SQLite (WAL), each with the time
the message was sent and the time after which it is too old to be accepted anyway (`open_envelope`
rejects it with `ExpiredError`). Past that time the entry is useless and is pruned, so the table
holds only the messages of the last age window: growth is bounded by traffic per window, not by
uptime.

Pruning forgets, so the guard remembers how far it forgot: the *horizon* is the latest send time
of any pruned entry, and a message sent at or before it is refused (`ExpiredError`) whatever the
receiver's age limit. Without it, a receiver restarted with a larger `max_age_s` would accept
again a message whose record had been pruned under the smaller one. Expired entries count as
pruned the moment they expire (every check prunes first), so the outcome never depends on when
pruning last ran. Receivers sharing one file should use the same age limit: the shortest one
sets the horizon for all.

A seen-set (rather than a per-sender high-water mark) lets one sender have several messages in
flight that arrive out of order, and lets senders use random nonces.

The check is one write transaction (prune, horizon, insert): atomic across threads (one
connection behind a lock) and across processes sharing the file (SQLite's write lock).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType

from protocol.errors import ExpiredError, ReplayError

log = logging.getLogger(__name__)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS seen (
        domain TEXT NOT NULL,
        signer TEXT NOT NULL,
        nonce TEXT NOT NULL,         -- decimal text: nonces may exceed SQLite's 64-bit integers
        expires_at REAL NOT NULL,    -- unix seconds after which the message is expired anyway
        sent_at REAL NOT NULL,       -- the message's own timestamp, unix seconds
        PRIMARY KEY (domain, signer, nonce)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS seen_expiry ON seen (expires_at)",
    # One row: messages sent at or before `sent_at` may have been forgotten (NULL: nothing pruned yet).
    "CREATE TABLE IF NOT EXISTS horizon (id INTEGER PRIMARY KEY CHECK (id = 0), sent_at REAL)",
    "INSERT OR IGNORE INTO horizon VALUES (0, NULL)",
)


class ReplayGuard:
    """Durable (domain, signer, nonce) seen-set. `path` may be `":memory:"` for a throwaway guard.

    `prune_every` is accepted for compatibility and ignored: every check prunes what has expired
    (an index range scan over just those entries), which keeps the horizon exact.
    """

    def __init__(self, path: str | Path, *, prune_every: int = 1000, busy_timeout_s: float = 30.0) -> None:
        del prune_every
        self.path = str(path)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        if self.path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        with self._transaction():
            self._migrate()
            for statement in _SCHEMA:
                self._conn.execute(statement)

    def _transaction(self) -> _Transaction:
        return _Transaction(self._conn)

    def _migrate(self) -> None:
        """Files written before the horizon existed lack `sent_at`: use `expires_at` (an upper
        bound of the send time, so the horizon errs towards refusing)."""
        cols = [row[1] for row in self._conn.execute("PRAGMA table_info(seen)")]
        if cols and "sent_at" not in cols:
            self._conn.execute("ALTER TABLE seen ADD COLUMN sent_at REAL NOT NULL DEFAULT 0")
            self._conn.execute("UPDATE seen SET sent_at = expires_at")

    def check_and_record(
        self,
        domain: str,
        signer: str,
        nonce: int,
        *,
        sent_at: float,
        expires_at: float,
        now: float | None = None,
    ) -> None:
        """Record the nonce, or raise `ReplayError` if it is recorded and not yet expired, or
        `ExpiredError` if the message was sent at or before the horizon (it may have been pruned)."""
        now_s = time.time() if now is None else now
        key = (domain, signer, str(nonce))
        refusal: ExpiredError | ReplayError | None = None
        with self._lock, self._transaction():  # a refusal still commits the pruning
            _, horizon = self._prune_locked(now_s)
            if sent_at <= horizon:
                refusal = ExpiredError(
                    f"message sent at {sent_at:.3f} is at or before the replay guard's horizon {horizon:.3f}"
                    " (its record may have been pruned)"
                )
            else:
                try:
                    self._conn.execute("INSERT INTO seen VALUES (?, ?, ?, ?, ?)", (*key, expires_at, sent_at))
                except sqlite3.IntegrityError:
                    # Expired entries were pruned just above, so the entry found is live.
                    refusal = ReplayError(f"nonce {nonce} from {signer} already used in {domain!r}")
        if refusal is not None:
            raise refusal

    @property
    def horizon(self) -> float:
        """Messages sent at or before this time (unix seconds) are refused; -inf before any prune."""
        with self._lock:
            return self._horizon_locked()

    def _horizon_locked(self) -> float:
        value = self._conn.execute("SELECT sent_at FROM horizon").fetchone()[0]
        return float("-inf") if value is None else float(value)

    def prune(self, now: float | None = None) -> int:
        """Drop entries whose messages have expired (raising the horizon); returns how many."""
        with self._lock, self._transaction():
            removed, _ = self._prune_locked(time.time() if now is None else now)
            return removed

    def _prune_locked(self, now_s: float) -> tuple[int, float]:
        """Inside a transaction: forget expired entries and move the horizon up to the latest send
        time among them. Returns (entries removed, horizon)."""
        latest = self._conn.execute("SELECT MAX(sent_at) FROM seen WHERE expires_at < ?", (now_s,)).fetchone()[0]
        if latest is None:
            return 0, self._horizon_locked()
        removed = int(self._conn.execute("DELETE FROM seen WHERE expires_at < ?", (now_s,)).rowcount)
        self._conn.execute("UPDATE horizon SET sent_at = MAX(COALESCE(sent_at, ?1), ?1)", (latest,))
        log.debug("replay guard pruned %d expired nonces", removed)
        return removed, self._horizon_locked()

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM seen").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ReplayGuard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (`ROLLBACK` on an exception): takes SQLite's write lock up
    front, so two processes cannot both read the horizon and then both insert."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._conn.execute("ROLLBACK" if exc_type is not None else "COMMIT")


class RereadRecords:
    """The replay guard for signed *records* that are read again, not acted on once per nonce: a
    verdict a node polls twice, an envelope carried inside an appeal, a feed item fetched again after a
    resume. Whoever uses it de-duplicates by something stronger than the nonce (the work key), so it
    accepts every nonce; the other envelope checks (domain, signer, signature, body) still apply."""

    def check_and_record(
        self, domain: str, signer: str, nonce: int, *, sent_at: float, expires_at: float, now: float | None = None
    ) -> None:
        return None
