"""The verdict ledger: one durable row per work key, its state machine, evidence, and the trainer feed.

States of a row (column `state`), each change one transaction:

    received ──(checks)──► decided ──(chain reporter)──► reported
                 │  (our failure: attempts += 1, retried; soft after `retries`)
                 └─ decided at once when a cheap check already failed

`outcome`/`reason` are set with `decided`. An accepted row enters the `feed` table in the same
transaction (the trainer's queue: `feed.seq` is its cursor), so an accepted rollout is always either
queued or handed out; a crash between any two steps leaves a row a restarted validator finishes
(`claim()` and `unreported()` read exactly the unfinished rows). Only a `received` row is decided:
when two checkers held the same row, the first verdict stands (`redecide` replaces one on purpose).

SQLite (WAL) by default; PostgreSQL when several validator processes share one ledger (the SQL is
the common subset; `?` placeholders are rewritten for psycopg). Claims of pending rows use a lease
(`lease_until`, `lease_owner`), so two processes never check the same row at once; a restarted
process frees the leases its killed predecessor held (`recover`), others' run out.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from protocol.errors import PrimeError


class LedgerError(PrimeError):
    """The ledger database cannot be opened or written."""

    code = "ledger"


_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS submissions (
        work_key TEXT PRIMARY KEY,
        submission_hash TEXT NOT NULL UNIQUE,
        node TEXT NOT NULL,
        policy_version BIGINT NOT NULL,
        counter BIGINT NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        envelope {blob} NOT NULL,
        state TEXT NOT NULL,
        outcome TEXT,
        reason TEXT,
        detail TEXT,
        measurements TEXT,
        evidence_hash TEXT,
        verdict {blob},
        decided_at DOUBLE PRECISION,
        attempts INTEGER NOT NULL DEFAULT 0,
        lease_until DOUBLE PRECISION,
        lease_owner TEXT,
        reported_at DOUBLE PRECISION,
        chain_tx TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS submissions_state ON submissions (state)",
    "CREATE INDEX IF NOT EXISTS submissions_node ON submissions (node)",
    """CREATE TABLE IF NOT EXISTS evidence (
        hash TEXT PRIMARY KEY,
        data {blob} NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS feed (
        seq {serial},
        work_key TEXT NOT NULL UNIQUE,
        created_at DOUBLE PRECISION NOT NULL,
        item {blob} NOT NULL,
        file_written INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE IF NOT EXISTS appeals (
        work_key TEXT PRIMARY KEY,
        node TEXT NOT NULL,
        slasher TEXT NOT NULL,
        appellant TEXT NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        appeal {blob} NOT NULL,
        original_reason TEXT NOT NULL,
        outcome TEXT NOT NULL,
        reason TEXT NOT NULL,
        detail TEXT,
        measurements TEXT,
        units BIGINT NOT NULL,
        evidence_hash TEXT NOT NULL,
        decision {blob} NOT NULL,
        resolved_at DOUBLE PRECISION,
        chain_tx TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS refusals (
        node TEXT NOT NULL,
        reason TEXT NOT NULL,
        count BIGINT NOT NULL,
        last_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (node, reason)
    )""",
]

_COLUMNS = (
    "work_key, submission_hash, node, policy_version, counter, received_at, envelope, state, outcome, "
    "reason, detail, measurements, evidence_hash, verdict, decided_at, attempts, reported_at, chain_tx"
)


@dataclass(frozen=True)
class Row:
    """One submission's ledger row."""

    work_key: str
    submission_hash: str
    node: str
    policy_version: int
    counter: int
    received_at: float
    envelope: bytes
    state: str
    outcome: str | None
    reason: str | None
    detail: str | None
    measurements: str | None
    evidence_hash: str | None
    verdict: bytes | None
    decided_at: float | None
    attempts: int
    reported_at: float | None
    chain_tx: str | None


@dataclass(frozen=True)
class Decision:
    """What the checks concluded about one row."""

    outcome: str
    reason: str
    detail: str = ""
    measurements: dict[str, Any] | None = None
    evidence: bytes | None = None
    evidence_hash: str | None = None
    verdict: bytes | None = None
    """The signed `Verdict` envelope bytes."""
    feed_item: bytes | None = None
    """For an accepted row: the signed feed item that enters the trainer's queue."""


_APPEAL_COLUMNS = (
    "work_key, node, slasher, appellant, received_at, appeal, original_reason, outcome, reason, detail, "
    "measurements, units, evidence_hash, decision, resolved_at, chain_tx"
)


@dataclass(frozen=True)
class AppealRow:
    """One appeal this validator decided (`POST /v1/appeals`): one row per work key, resolved on chain once."""

    work_key: str
    node: str
    slasher: str
    """The validator whose hard verdict was appealed."""
    appellant: str
    """Who signed the appeal (the node key or its operator)."""
    received_at: float
    appeal: bytes
    """The signed `Appeal` envelope as received."""
    original_reason: str
    outcome: str
    """`overturned` or `upheld`."""
    reason: str
    detail: str | None
    measurements: str | None
    units: int
    """Work units the submission is worth (recorded on chain when overturned)."""
    evidence_hash: str
    decision: bytes
    """The signed `AppealDecision` envelope."""
    resolved_at: float | None
    chain_tx: str | None


class _Db(Protocol):
    skip_locked: str
    """Appended to the claim's row selection: concurrent claimers pass over each other's rows."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    @contextmanager
    def transaction(self) -> Iterator[_Db]: ...

    def lock(self, key: int) -> None:
        """Inside a transaction: wait for, and hold until it ends, the database-wide lock `key`."""

    def close(self) -> None: ...


# Database-wide locks (PostgreSQL advisory locks; SQLite's one writer at a time already serializes).
_LOCK_SCHEMA = 0x7072696D65_01  # concurrent CREATE TABLE IF NOT EXISTS collide in the catalog
_LOCK_FEED = 0x7072696D65_02  # feed numbers are taken in commit order (see `_decide`)


class _Sqlite:
    blob, serial, skip_locked = "BLOB", "INTEGER PRIMARY KEY AUTOINCREMENT", ""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")  # a decided verdict survives power loss
        except sqlite3.Error as exc:
            raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
        self._lock = threading.RLock()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._conn.execute(sql, tuple(params)).fetchall()
            except sqlite3.Error as exc:
                raise LedgerError(f"ledger: {exc}") from exc

    @contextmanager
    def transaction(self) -> Iterator[_Db]:
        with self._lock:
            self.execute("BEGIN IMMEDIATE")  # the write lock now: one writer, in commit order
            try:
                yield self
                self.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:  # never leave the connection inside a dead transaction
                    try:
                        self._conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # the original error is the one to report
                raise

    def lock(self, key: int) -> None:
        pass  # BEGIN IMMEDIATE holds the database's only write lock

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _Postgres:
    blob, serial, skip_locked = "BYTEA", "BIGSERIAL PRIMARY KEY", " FOR UPDATE SKIP LOCKED"

    def __init__(self, dsn: str) -> None:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - psycopg is a declared dependency
            raise LedgerError("a PostgreSQL ledger needs psycopg (pip install 'psycopg[binary]')") from exc
        self._psycopg = psycopg
        self._dsn = dsn
        self._lock = threading.RLock()
        self._in_tx = False
        self._closed = False
        self._conn = self._connect()

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self._dsn, autocommit=True)
        except self._psycopg.Error as exc:
            raise LedgerError(f"cannot connect to the PostgreSQL ledger: {exc}") from exc

    def _live(self) -> Any:
        """The connection; a new one when the server dropped the last (a restart, a failover, an idle
        timeout). Never inside a transaction: its statements must not continue on another session."""
        if (self._conn.closed or self._conn.broken) and not self._in_tx and not self._closed:
            self._conn = self._connect()
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                cur = self._live().execute(sql.replace("?", "%s"), tuple(params))
                rows = cur.fetchall() if cur.description else []
            except self._psycopg.Error as exc:
                raise LedgerError(f"ledger: {exc}") from exc
            return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]

    @contextmanager
    def transaction(self) -> Iterator[_Db]:
        with self._lock:
            try:
                with self._live().transaction():
                    self._in_tx = True
                    try:
                        yield self
                    finally:
                        self._in_tx = False
            except self._psycopg.Error as exc:
                raise LedgerError(f"ledger transaction: {exc}") from exc

    def lock(self, key: int) -> None:
        self.execute("SELECT pg_advisory_xact_lock(?)", (key,))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()


class Ledger:
    """The durable record of every submission (see the module docstring)."""

    def __init__(self, db: _Db, owner: str | None = None) -> None:
        self._db = db
        self.owner = owner or f"anonymous-{uuid.uuid4().hex}"
        """Whose leases this ledger takes: stable across restarts of one process (see `recover`)."""
        blob, serial = getattr(db, "blob"), getattr(db, "serial")  # noqa: B009 - per-dialect class attributes
        with db.transaction():
            db.lock(_LOCK_SCHEMA)
            for stmt in _SCHEMA:
                db.execute(stmt.format(blob=blob, serial=serial))

    @classmethod
    def open(cls, *, dsn: str | None = None, path: str | Path | None = None, owner: str | None = None) -> Ledger:
        """PostgreSQL when `dsn` is given, else SQLite at `path`.

        `owner` names the process among those sharing the ledger, the same after a restart (e.g. host
        and state directory), so that `recover` can free the leases its killed predecessor held.
        """
        if dsn:
            return cls(_Postgres(dsn), owner)
        if path is None:
            raise LedgerError("a ledger needs a PostgreSQL DSN or a SQLite path")
        return cls(_Sqlite(Path(path)), owner)

    def close(self) -> None:
        self._db.close()

    # -- submissions ----------------------------------------------------------------------------

    def _rows(self, where: str, params: Sequence[Any] = ()) -> list[Row]:
        return [Row(*r) for r in self._db.execute(f"SELECT {_COLUMNS} FROM submissions {where}", params)]

    def get(self, work_key: str) -> Row | None:
        rows = self._rows("WHERE work_key = ?", (work_key,))
        return rows[0] if rows else None

    def by_hash(self, submission_hash: str) -> Row | None:
        rows = self._rows("WHERE submission_hash = ?", (submission_hash,))
        return rows[0] if rows else None

    def insert(
        self, *, work_key: str, submission_hash: str, node: str, policy_version: int, counter: int,
        envelope: bytes, decision: Decision | None = None, now: float | None = None,
    ) -> bool:
        """Add a received submission (decided at once when `decision` is given).

        False, and nothing written, when the work key already has a row (one row per work key).
        """
        t = time.time() if now is None else now
        with self._db.transaction() as db:
            done = db.execute(
                "INSERT INTO submissions (work_key, submission_hash, node, policy_version, counter, received_at, "
                "envelope, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'received') ON CONFLICT DO NOTHING RETURNING work_key",
                (work_key, submission_hash, node, policy_version, counter, t, envelope),
            )
            if not done:
                return False
            if decision is not None:
                self._decide(db, work_key, decision, t)
        return True

    def _decide(self, db: _Db, work_key: str, d: Decision, now: float, *, only_received: bool = True) -> bool:
        which = "work_key = ? AND state = 'received'" if only_received else "work_key = ?"
        done = db.execute(
            "UPDATE submissions SET state = 'decided', outcome = ?, reason = ?, detail = ?, measurements = ?, "
            f"evidence_hash = ?, verdict = ?, decided_at = ?, lease_until = NULL, lease_owner = NULL WHERE {which} "
            "RETURNING work_key",
            (d.outcome, d.reason, d.detail, json.dumps(d.measurements) if d.measurements is not None else None,
             d.evidence_hash, d.verdict, now, work_key),
        )
        if not done:
            return False
        if d.evidence is not None and d.evidence_hash is not None:
            db.execute("INSERT INTO evidence (hash, data, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                       (d.evidence_hash, d.evidence, now))
        if d.feed_item is not None:
            # Trainers read the feed by `seq` cursor, so numbers must become visible in order: with
            # several writers, one that took seq N and commits after N+1 was read would be skipped.
            db.lock(_LOCK_FEED)
            db.execute("INSERT INTO feed (work_key, created_at, item) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                       (work_key, now, d.feed_item))
        return True

    def decide(self, work_key: str, decision: Decision, *, now: float | None = None) -> bool:
        """Record the verdict (and its evidence and feed item) of a received row, atomically.

        False, and nothing written, when the row is not `received` (any more): the first verdict stands
        when two checkers held it (a lease that ran out mid-check). Use `redecide` to replace one.
        """
        with self._db.transaction() as db:
            return self._decide(db, work_key, decision, time.time() if now is None else now)

    def redecide(self, work_key: str, decision: Decision, *, now: float | None = None) -> None:
        """Replace a verdict (equivocation turns an accepted row hard); the row is reported again.

        A rejection also takes the row's item out of the feed, so a trainer that has not fetched it yet
        never will (one already fetched, or a Parquet file already written, cannot be called back)."""
        with self._db.transaction() as db:
            db.execute("UPDATE submissions SET reported_at = NULL, chain_tx = NULL WHERE work_key = ?", (work_key,))
            if decision.outcome != "accepted":
                db.execute("DELETE FROM feed WHERE work_key = ?", (work_key,))
            self._decide(db, work_key, decision, time.time() if now is None else now, only_received=False)

    def claim(self, limit: int, *, lease_s: float = 300.0, now: float | None = None) -> list[Row]:
        """Lease up to `limit` received rows for checking, oldest first. Another claimer (thread or
        process) gets other rows; a killed claimer's lease runs out (or its successor calls `recover`)."""
        t = time.time() if now is None else now
        free = "state = 'received' AND (lease_until IS NULL OR lease_until < ?)"
        # One statement: SQLite takes its write lock before reading; PostgreSQL locks the picked rows and
        # skips those another claimer is locking. MATERIALIZED: the pick runs once (a LIMIT re-run per
        # outer row would lease more than `limit`).
        keys = self._db.execute(
            f"WITH picked AS MATERIALIZED (SELECT work_key FROM submissions WHERE {free} ORDER BY received_at "
            f"LIMIT ?{self._db.skip_locked}) UPDATE submissions SET lease_until = ?, lease_owner = ? "
            "WHERE work_key IN (SELECT work_key FROM picked) RETURNING work_key",
            (t, limit, t + lease_s, self.owner),
        )
        if not keys:
            return []
        marks = ", ".join("?" * len(keys))
        return self._rows(f"WHERE work_key IN ({marks}) ORDER BY received_at, work_key", [k for (k,) in keys])

    def release(self, work_key: str, error: str) -> int:
        """Give a leased row back after a failure on our side; returns its attempt count."""
        rows = self._db.execute(
            "UPDATE submissions SET lease_until = NULL, lease_owner = NULL, attempts = attempts + 1, detail = ? "
            "WHERE work_key = ? AND state = 'received' RETURNING attempts", (error[:500], work_key))
        return int(rows[0][0]) if rows else 0

    def recover(self) -> int:
        """At start: free the leases this owner still holds (its previous run was killed mid-check), so
        those rows are checked now rather than when the leases run out. Returns how many."""
        return len(self._db.execute(
            "UPDATE submissions SET lease_until = NULL, lease_owner = NULL WHERE state = 'received' AND "
            "lease_owner = ? RETURNING work_key", (self.owner,)))

    def unreported(self, limit: int) -> list[Row]:
        return self._rows("WHERE state = 'decided' ORDER BY decided_at LIMIT ?", (limit,))

    def mark_reported(self, work_keys: Sequence[str], tx_hash: str | None, *, now: float | None = None,
                      outcome: str | None = None) -> None:
        """Rows are reported. With `outcome`, only while the row still has that outcome: a verdict replaced
        (`redecide`) while the reporter was sending the old one stays `decided` and is reported again."""
        t = time.time() if now is None else now
        same = "" if outcome is None else " AND outcome = ?"
        with self._db.transaction() as db:
            for key in work_keys:
                db.execute("UPDATE submissions SET state = 'reported', reported_at = ?, chain_tx = ? "
                           f"WHERE work_key = ? AND state = 'decided'{same}",
                           (t, tx_hash, key) + (() if outcome is None else (outcome,)))

    def counts(self) -> dict[str, int]:
        """Rows per state and per outcome (for /metrics and the audit)."""
        out: dict[str, int] = {}
        for state, n in self._db.execute("SELECT state, COUNT(*) FROM submissions GROUP BY state"):
            out[f"state:{state}"] = int(n)
        for outcome, n in self._db.execute(
                "SELECT outcome, COUNT(*) FROM submissions WHERE outcome IS NOT NULL GROUP BY outcome"):
            out[f"outcome:{outcome}"] = int(n)
        return out

    def audit(self) -> dict[str, Any]:
        """This validator's side of the audit (`GET /v1/audit`): row counts (received = accepted +
        rejected_hard + rejected_soft + pending), and per row kind the work keys an auditor reconciles
        with the chain and the trainer: accepted (node, units, feed seq, chain tx), hard (reason,
        evidence hash, whether the evidence is stored) and soft (reason); and `restored`: work whose hard verdict
        (another validator's) this validator overturned on appeal, with its feed seq (it is trained too)."""
        rows = self._db.execute("SELECT work_key, node, state, outcome, reason, measurements, evidence_hash, "
                                "chain_tx FROM submissions ORDER BY received_at, work_key")
        # after the rows: an accepted row entered the feed (and its evidence was stored) in its own transaction
        feed = {k: int(s) for s, k in self._db.execute("SELECT seq, work_key FROM feed")}
        stored = {h for (h,) in self._db.execute("SELECT hash FROM evidence")}
        accepted, hard, soft = [], [], []
        per_node: dict[str, dict[str, int]] = {}
        pending = 0
        for key, node, state, outcome, reason, measurements, evidence_hash, tx in rows:
            counts = per_node.setdefault(node, {"received": 0, "accepted": 0, "rejected_hard": 0,
                                                "rejected_soft": 0, "pending": 0})
            counts["received"] += 1
            if outcome is None:
                pending += 1
                counts["pending"] += 1
                continue
            counts[outcome] = counts.get(outcome, 0) + 1
            reported = state == "reported"
            if outcome == "accepted":
                units = int(json.loads(measurements or "{}").get("units", 1))
                accepted.append({"work_key": key, "node": node, "units": units, "feed_seq": feed.get(key),
                                 "reported": reported, "chain_tx": tx})
            elif outcome == "rejected_hard":
                hard.append({"work_key": key, "node": node, "reason": reason, "evidence_hash": evidence_hash,
                             "evidence_stored": evidence_hash in stored, "reported": reported, "chain_tx": tx})
            else:
                soft.append({"work_key": key, "node": node, "reason": reason, "reported": reported,
                             "chain_tx": tx})
        # work this validator restored by overturning another's hard verdict: fed to the trainer like accepted work
        restored = [{"work_key": key, "node": node, "units": int(units), "feed_seq": feed.get(key),
                     "resolved": resolved is not None, "chain_tx": tx}
                    for key, node, units, resolved, tx in self._db.execute(
                        "SELECT work_key, node, units, resolved_at, chain_tx FROM appeals WHERE outcome = 'overturned' "
                        "ORDER BY received_at, work_key")]
        return {
            "counts": {"received": sum(c["received"] for c in per_node.values()), "accepted": len(accepted),
                       "rejected_hard": len(hard), "rejected_soft": len(soft), "pending": pending},
            "nodes": per_node, "accepted": accepted, "rejected_hard": hard, "rejected_soft": soft,
            "restored": restored, "feed_size": len(feed),
        }

    def timeline(self, after: float, limit: int) -> list[dict[str, Any]]:
        """Submissions received after `after` (unix time), oldest first, at most `limit`: when each arrived,
        from whom, at which version, and its verdict so far (`GET /v1/submissions`, the operator's view)."""
        return [{"work_key": key, "node": node, "policy_version": int(version), "received_at": float(received),
                 "outcome": outcome, "reason": reason, "decided_at": decided}
                for key, node, version, received, outcome, reason, decided in self._db.execute(
                    "SELECT work_key, node, policy_version, received_at, outcome, reason, decided_at "
                    "FROM submissions WHERE received_at > ? ORDER BY received_at, work_key LIMIT ?",
                    (after, limit))]

    def node_summary(self, node: str) -> dict[str, Any]:
        """Verdict counts by outcome and reason for one node, plus its refused requests."""
        verdicts: dict[str, dict[str, int]] = {}
        for outcome, reason, n in self._db.execute(
                "SELECT outcome, reason, COUNT(*) FROM submissions WHERE node = ? AND outcome IS NOT NULL "
                "GROUP BY outcome, reason", (node,)):
            verdicts.setdefault(outcome, {})[reason] = int(n)
        pending = self._db.execute("SELECT COUNT(*) FROM submissions WHERE node = ? AND state = 'received'", (node,))
        refused = {r: int(n) for r, n in self._db.execute(
            "SELECT reason, count FROM refusals WHERE node = ?", (node,))}
        return {"node": node, "verdicts": verdicts, "pending": int(pending[0][0]), "refused": refused}

    def hard_failures_since(self, policy_version: int, since: float) -> list[str]:
        """Distinct nodes with a hard verdict at `policy_version` decided since `since`."""
        return [n for (n,) in self._db.execute(
            "SELECT DISTINCT node FROM submissions WHERE policy_version = ? AND decided_at >= ? AND "
            "(outcome = 'rejected_hard' OR reason = 'suspected_systemic')", (policy_version, since))]

    def active_nodes_since(self, since: float) -> list[str]:
        return [n for (n,) in self._db.execute(
            "SELECT DISTINCT node FROM submissions WHERE received_at >= ?", (since,))]

    # -- refusals (requests that never became a row, counted per signed sender) ------------------

    def count_refusal(self, node: str, reason: str, *, now: float | None = None) -> None:
        t = time.time() if now is None else now
        self._db.execute(
            "INSERT INTO refusals (node, reason, count, last_at) VALUES (?, ?, 1, ?) ON CONFLICT (node, reason) "
            "DO UPDATE SET count = refusals.count + 1, last_at = excluded.last_at", (node, reason, t))

    # -- evidence and feed ----------------------------------------------------------------------

    def evidence(self, evidence_hash: str) -> bytes | None:
        rows = self._db.execute("SELECT data FROM evidence WHERE hash = ?", (evidence_hash,))
        return bytes(rows[0][0]) if rows else None

    def feed(self, after: int, limit: int) -> list[tuple[int, str, bytes]]:
        """(seq, work_key, signed item) of accepted submissions with seq > `after`, in order."""
        return [(int(s), k, bytes(i)) for s, k, i in self._db.execute(
            "SELECT seq, work_key, item FROM feed WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit))]

    def unwritten_feed(self, limit: int) -> list[tuple[int, float, str, bytes]]:
        """(seq, created_at, work_key, item) of feed items not yet written as files."""
        return [(int(s), float(c), k, bytes(i)) for s, c, k, i in self._db.execute(
            "SELECT seq, created_at, work_key, item FROM feed WHERE file_written = 0 ORDER BY seq LIMIT ?", (limit,))]

    def mark_written(self, seq: int) -> None:
        self._db.execute("UPDATE feed SET file_written = 1 WHERE seq = ?", (seq,))

    def feed_size(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM feed")[0][0])
    # -- appeals -------------------------------------------------------------------------------

    def appeal(self, work_key: str) -> AppealRow | None:
        rows = self._db.execute(f"SELECT {_APPEAL_COLUMNS} FROM appeals WHERE work_key = ?", (work_key,))
        return AppealRow(*rows[0]) if rows else None

    def record_appeal(self, row: AppealRow, evidence: bytes, feed_item: bytes | None = None) -> bool:
        """Store a decided appeal and its evidence, atomically. False (nothing written) when the work key's
        appeal was decided before: the first decision stands. `feed_item` (an overturned appeal: the work is
        restored) enters the trainer feed in the same transaction, like an accepted row's."""
        with self._db.transaction() as db:
            done = db.execute(
                f"INSERT INTO appeals ({_APPEAL_COLUMNS}) VALUES ({', '.join('?' * 16)}) ON CONFLICT DO NOTHING "
                "RETURNING work_key",
                (row.work_key, row.node, row.slasher, row.appellant, row.received_at, row.appeal,
                 row.original_reason, row.outcome, row.reason, row.detail, row.measurements, row.units,
                 row.evidence_hash, row.decision, row.resolved_at, row.chain_tx))
            if not done:
                return False
            db.execute("INSERT INTO evidence (hash, data, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                       (row.evidence_hash, evidence, row.received_at))
            if feed_item is not None:
                db.lock(_LOCK_FEED)  # feed numbers in commit order (see `_decide`)
                db.execute("INSERT INTO feed (work_key, created_at, item) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                           (row.work_key, row.received_at, feed_item))
        return True

    def withdraw_feed(self, work_key: str) -> bool:
        """Take a work key's item out of the feed (a restoration the chain settled the other way); True if it was
        there. A trainer that fetched it already, or a Parquet file already written, cannot be called back."""
        return bool(self._db.execute("DELETE FROM feed WHERE work_key = ? RETURNING work_key", (work_key,)))

    def unresolved_appeals(self, limit: int) -> list[AppealRow]:
        """Decided appeals not yet resolved on chain, oldest first."""
        return [AppealRow(*r) for r in self._db.execute(
            f"SELECT {_APPEAL_COLUMNS} FROM appeals WHERE resolved_at IS NULL ORDER BY received_at LIMIT ?",
            (limit,))]

    def mark_appeal_resolved(self, work_key: str, tx_hash: str | None, *, now: float | None = None) -> None:
        self._db.execute("UPDATE appeals SET resolved_at = ?, chain_tx = ? WHERE work_key = ? AND resolved_at IS NULL",
                         (time.time() if now is None else now, tx_hash, work_key))

