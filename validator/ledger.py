"""The verdict ledger: one durable row per work key, its state machine, evidence, and the trainer feed.

States of a row (column `state`), each change one transaction:

    received ──(checks)──► decided ──(chain reporter)──► reported
                 │  (our failure: attempts += 1, retried; soft after `retries`)
                 │                  └──(a revert no retry can fix)──► unreportable (`report_error` says why)
                 └─ decided at once when a cheap check already failed

A decided row whose transaction failed for a reason that may pass (budget, pause) waits until
`report_after` (`defer_report`), so it never holds up the rows behind it; the reporter reads the
outbox by kind (`outbox`), without envelopes, one page at a time.

Row counts by state and outcome (`counts`, for /metrics and the audit) are tallies kept in the same
transactions as the rows they count (`tallies`), so reading them never scans the ledger.

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
import logging
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
from validator.judge import Measurements

log = logging.getLogger(__name__)


class LedgerError(PrimeError):
    """The ledger database cannot be opened or written."""

    code = "ledger"


_DRIFT_MARK = '%"drift_band": true%'
"""How a hard verdict in the drift band is marked in its stored measurements (`json.dumps` spelling)."""

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
    """CREATE TABLE IF NOT EXISTS tallies (
        kind TEXT PRIMARY KEY,
        n BIGINT NOT NULL
    )""",
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
    # the assignments of one (node, version), for the counter-order check and the hole count
    "CREATE INDEX IF NOT EXISTS submissions_assignment ON submissions (node, policy_version, counter)",
    # per node: bytes of its envelopes stored here and not pruned (kept with the rows, so a restart keeps them)
    """CREATE TABLE IF NOT EXISTS node_bytes (
        node TEXT PRIMARY KEY,
        stored BIGINT NOT NULL
    )""",
    # per node: the near-tie account of its accepted work here (kept with the rows by `_decide`: no scan to read)
    """CREATE TABLE IF NOT EXISTS node_ties (
        node TEXT PRIMARY KEY,
        tokens BIGINT NOT NULL,
        near_ties BIGINT NOT NULL,
        eos_near_ties BIGINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS counter_holes (
        node TEXT NOT NULL,
        policy_version BIGINT NOT NULL,
        first_counter BIGINT NOT NULL,
        last_counter BIGINT NOT NULL,
        holes BIGINT NOT NULL,
        counted_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (node, policy_version)
    )""",
]

# Columns added after the first release (older ledgers get them at open): the outbox's own bookkeeping.
_ADDED_COLUMNS = [
    ("report_attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("report_after", "DOUBLE PRECISION"),
    ("report_error", "TEXT"),
]
_INDEXES = [  # after the added columns exist
    # the pool notes read the holes of the last versions of every node (`holes_of_nodes`)
    "CREATE INDEX IF NOT EXISTS counter_holes_version ON counter_holes (policy_version)",
    "CREATE INDEX IF NOT EXISTS submissions_outbox ON submissions (state, outcome, decided_at)",
    "CREATE INDEX IF NOT EXISTS submissions_node_state ON submissions (node, state, outcome)",
    # the feed loop asks every 0.5 s for the items not written as files yet: without it, a scan of every item
    # (their blobs' overflow pages included: `file_written` is stored after `item`) that grew with the feed
    "CREATE INDEX IF NOT EXISTS feed_unwritten ON feed (seq) WHERE file_written = 0",
]

_COLUMNS = (
    "work_key, submission_hash, node, policy_version, counter, received_at, envelope, state, outcome, "
    "reason, detail, measurements, evidence_hash, verdict, decided_at, attempts, reported_at, chain_tx, "
    "report_error"
)
_OUTBOX_COLUMNS = "work_key, node, outcome, reason, measurements, evidence_hash, decided_at, report_attempts"


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
    report_error: str | None = None
    """Why the verdict could not be reported (yet): the last revert, or the one that made it `unreportable`."""


@dataclass(frozen=True)
class OutboxRow:
    """What the chain reporter needs of a decided row (no envelope: a page of these stays small)."""

    work_key: str
    node: str
    outcome: str
    reason: str
    measurements: str | None
    evidence_hash: str | None
    decided_at: float
    report_attempts: int

    @property
    def units(self) -> int:
        return Measurements.from_json(json.loads(self.measurements or "{}")).units or 1


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
    for_update: str
    """Appended to a selection whose rows the transaction then changes (PostgreSQL locks them)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    @contextmanager
    def transaction(self) -> Iterator[_Db]: ...

    def lock(self, key: int) -> None:
        """Inside a transaction: wait for, and hold until it ends, the database-wide lock `key`."""

    def add_column(self, table: str, name: str, decl: str) -> None:
        """Inside a transaction: add a column unless the table has it (a ledger from an older release)."""

    def close(self) -> None: ...


# Database-wide locks (PostgreSQL advisory locks; SQLite's one writer at a time already serializes).
_LOCK_SCHEMA = 0x7072696D65_01  # concurrent CREATE TABLE IF NOT EXISTS collide in the catalog
_LOCK_FEED = 0x7072696D65_02  # feed numbers are taken in commit order (see `_decide`)


class _Sqlite:
    blob, serial, skip_locked, for_update = "BLOB", "INTEGER PRIMARY KEY AUTOINCREMENT", "", ""

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

    def add_column(self, table: str, name: str, decl: str) -> None:
        if name not in {row[1] for row in self.execute(f"PRAGMA table_info({table})")}:
            self.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _Postgres:
    blob, serial, skip_locked, for_update = "BYTEA", "BIGSERIAL PRIMARY KEY", " FOR UPDATE SKIP LOCKED", " FOR UPDATE"

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

    def add_column(self, table: str, name: str, decl: str) -> None:
        self.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {decl}")

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
        self._refusals: dict[tuple[str, str], tuple[int, float]] = {}
        """(node, reason) -> (count, last time) refused since the last `flush_refusals`."""
        self._refusals_lock = threading.Lock()
        blob, serial = getattr(db, "blob"), getattr(db, "serial")  # noqa: B009 - per-dialect class attributes
        with db.transaction():
            db.lock(_LOCK_SCHEMA)
            for stmt in _SCHEMA:
                db.execute(stmt.format(blob=blob, serial=serial))
            for name, decl in _ADDED_COLUMNS:
                db.add_column("submissions", name, decl)
            for stmt in _INDEXES:
                db.execute(stmt)
            if not db.execute("SELECT n FROM tallies WHERE kind = ?", (_TALLIES_MARK,)):
                _count_from_rows(db)  # a ledger from before the tallies: counted once, kept from now on
            if not db.execute("SELECT n FROM tallies WHERE kind = ?", (_TIES_MARK,)):
                _ties_from_rows(db)  # a ledger from before the near-tie accounts: counted once, kept from now on

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
        try:
            self.flush_refusals()
        except LedgerError as exc:  # the database is going away: say what is lost, then close it anyway
            log.error("closing the ledger without its last refusal counts: %s", exc)
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
            _add_node_bytes(db, node, len(envelope))
            change = {"state:received": 1}
            if decision is not None:
                self._decide(db, work_key, decision, t, change)
            _tally(db, change)
        return True

    def _decide(self, db: _Db, work_key: str, d: Decision, now: float, change: dict[str, int], *,
                only_received: bool = True) -> bool:
        """Inside a transaction: record the verdict; what it changes in the tallies is added to `change` (the
        caller applies it once, at the end: every transaction takes the tally rows in one order)."""
        which = "work_key = ? AND state = 'received'" if only_received else "work_key = ?"
        before: list[tuple[Any, ...]] = [("received", None, None, None)]
        if not only_received:
            before = db.execute("SELECT state, outcome, node, measurements FROM submissions WHERE work_key = ?"
                                f"{db.for_update}", (work_key,))
        done = db.execute(
            "UPDATE submissions SET state = 'decided', outcome = ?, reason = ?, detail = ?, measurements = ?, "
            f"evidence_hash = ?, verdict = ?, decided_at = ?, lease_until = NULL, lease_owner = NULL WHERE {which} "
            "RETURNING work_key",
            (d.outcome, d.reason, d.detail, json.dumps(d.measurements) if d.measurements is not None else None,
             d.evidence_hash, d.verdict, now, work_key),
        )
        if not done:
            return False
        old_state, old_outcome, node, old_measurements = before[0]
        for kind, n in ((f"state:{old_state}", -1), ("state:decided", 1), (f"outcome:{d.outcome}", 1),
                        *(((f"outcome:{old_outcome}", -1),) if old_outcome is not None else ())):
            change[kind] = change.get(kind, 0) + n
        if old_outcome == "accepted" and old_measurements:  # an accepted row rejected after all: out of its account
            _add_ties(db, str(node), Measurements.from_json(json.loads(old_measurements)), -1)
        if d.outcome == "accepted" and d.measurements:
            if node is None:
                node = db.execute("SELECT node FROM submissions WHERE work_key = ?", (work_key,))[0][0]
            _add_ties(db, str(node), Measurements.from_json(d.measurements), 1)
        if d.evidence is not None and d.evidence_hash is not None:
            db.execute("INSERT INTO evidence (hash, data, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                       (d.evidence_hash, d.evidence, now))
        if d.feed_item is not None:
            # Trainers read the feed by `seq` cursor, so numbers must become visible in order: with
            # several writers, one that took seq N and commits after N+1 was read would be skipped.
            db.lock(_LOCK_FEED)
            if db.execute("INSERT INTO feed (work_key, created_at, item) VALUES (?, ?, ?) ON CONFLICT DO NOTHING "
                          "RETURNING seq", (work_key, now, d.feed_item)):
                change["feed"] = change.get("feed", 0) + 1
        return True

    def decide(self, work_key: str, decision: Decision, *, now: float | None = None) -> bool:
        """Record the verdict (and its evidence and feed item) of a received row, atomically.

        False, and nothing written, when the row is not `received` (any more): the first verdict stands
        when two checkers held it (a lease that ran out mid-check). Use `redecide` to replace one.
        """
        with self._db.transaction() as db:
            change: dict[str, int] = {}
            done = self._decide(db, work_key, decision, time.time() if now is None else now, change)
            _tally(db, change)
            return done

    def redecide(self, work_key: str, decision: Decision, *, now: float | None = None) -> None:
        """Replace a verdict (equivocation turns an accepted row hard); the row is reported again.

        A rejection also takes the row's item out of the feed, so a trainer that has not fetched it yet
        never will (one already fetched, or a Parquet file already written, cannot be called back)."""
        with self._db.transaction() as db:
            db.execute("UPDATE submissions SET reported_at = NULL, chain_tx = NULL, report_attempts = 0, "
                       "report_after = NULL, report_error = NULL WHERE work_key = ?", (work_key,))
            change: dict[str, int] = {}
            if decision.outcome != "accepted" and db.execute("DELETE FROM feed WHERE work_key = ? RETURNING seq",
                                                             (work_key,)):
                change["feed"] = -1
            self._decide(db, work_key, decision, time.time() if now is None else now, change, only_received=False)
            _tally(db, change)

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

    def unreported_hard(self, policy_version: int, page: int = 64) -> Iterator[Row]:
        """Hard verdicts of `policy_version` not yet on chain, oldest first, read `page` rows at a time (their
        envelopes never all in memory at once). A row redecided meanwhile is no longer hard: not read again."""
        after: tuple[float, str] = (float("-inf"), "")
        while True:
            rows = self._rows(
                "WHERE state = 'decided' AND outcome = 'rejected_hard' AND policy_version = ? AND "
                "(decided_at > ? OR (decided_at = ? AND work_key > ?)) ORDER BY decided_at, work_key LIMIT ?",
                (policy_version, after[0], after[0], after[1], page))
            yield from rows
            if len(rows) < page:
                return
            after = (float(rows[-1].decided_at or 0.0), rows[-1].work_key)

    def outbox(self, outcome: str, limit: int, *, now: float | None = None,
               decided_before: float | None = None) -> list[OutboxRow]:
        """Decided rows of `outcome` to report now, oldest first: decided at or before `decided_before`
        (the reporter holds hard verdicts for the systemic window), and not waiting out a `defer_report`.
        Each kind is read on its own, so a backlog of one kind never hides another."""
        t = time.time() if now is None else now
        return [OutboxRow(k, n, o, r, m, e, float(d), int(a)) for k, n, o, r, m, e, d, a in self._db.execute(
            f"SELECT {_OUTBOX_COLUMNS} FROM submissions WHERE state = 'decided' AND outcome = ? AND decided_at <= ? "
            "AND (report_after IS NULL OR report_after <= ?) ORDER BY decided_at, work_key LIMIT ?",
            (outcome, t if decided_before is None else decided_before, t, limit))]

    def defer_report(self, work_key: str, error: str, *, after: float, outcome: str) -> int:
        """The row's transaction failed for a reason that may pass: try again at `after` (unix time); rows
        behind it are reported meanwhile. Returns the row's count of failed reports."""
        rows = self._db.execute(
            "UPDATE submissions SET report_attempts = report_attempts + 1, report_after = ?, report_error = ? "
            "WHERE work_key = ? AND state = 'decided' AND outcome = ? RETURNING report_attempts",
            (after, error[:500], work_key, outcome))
        return int(rows[0][0]) if rows else 0

    def mark_unreportable(self, work_key: str, error: str, *, outcome: str, now: float | None = None) -> bool:
        """The verdict can never land on chain (a revert no retry changes): it leaves the outbox with the reason.
        Only while the row still has `outcome` (a verdict replaced meanwhile is reported anew)."""
        t = time.time() if now is None else now
        with self._db.transaction() as db:
            done = db.execute(
                "UPDATE submissions SET state = 'unreportable', reported_at = ?, report_error = ? "
                "WHERE work_key = ? AND state = 'decided' AND outcome = ? RETURNING work_key",
                (t, error[:500], work_key, outcome))
            if done:
                _tally(db, {"state:decided": -1, "state:unreportable": 1})
        return bool(done)

    def backlog(self) -> int:
        """Rows not yet decided or not yet reported (from the tallies: no scan)."""
        counts = self.counts()
        return counts.get("state:received", 0) + counts.get("state:decided", 0)

    def hard_pending(self, node: str, *, reported_since: float | None = None) -> bool:
        """Whether `node` has a hard verdict here that is not on chain yet (the slash is still to come), or
        (with `reported_since`) one reported since then (the slash landed but may not have been read back)."""
        recent = "" if reported_since is None else " OR (state = 'reported' AND reported_at >= ?)"
        return bool(self._db.execute(
            f"SELECT 1 FROM submissions WHERE node = ? AND outcome = 'rejected_hard' AND (state = 'decided'{recent}) "
            "LIMIT 1", (node,) + (() if reported_since is None else (reported_since,))))

    def near_tie_evidence(self, node: str) -> NearTieAccount:
        """The near-tie account of `node`'s accepted work on this validator with the rows that hold near-ties (the
        evidence of a `near_tie_steering` verdict): a scan of the node's rows, read only once a verdict is due
        (the decision itself reads the kept tally, `near_tie_account`, and the pool's, `PoolView`)."""
        acc = [0, 0, 0]
        rows: list[tuple[str, int, int]] = []
        for key, measurements in self._db.execute(
                "SELECT work_key, measurements FROM submissions WHERE node = ? AND outcome = 'accepted' "
                "ORDER BY received_at, work_key", (node,)):
            before = acc[:2]
            count_ties(acc, Measurements.from_json(json.loads(measurements or "{}")))
            if acc[1] > before[1]:
                rows.append((key, acc[0] - before[0], acc[1] - before[1]))
        return NearTieAccount(tokens=acc[0], near_ties=acc[1], rows=tuple(rows))

    def mark_reported(self, work_keys: Sequence[str], tx_hash: str | None, *, now: float | None = None,
                      outcome: str | None = None) -> None:
        """Rows are reported. With `outcome`, only while the row still has that outcome: a verdict replaced
        (`redecide`) while the reporter was sending the old one stays `decided` and is reported again."""
        t = time.time() if now is None else now
        same = "" if outcome is None else " AND outcome = ?"
        with self._db.transaction() as db:
            moved = 0
            for key in work_keys:
                moved += len(db.execute("UPDATE submissions SET state = 'reported', reported_at = ?, chain_tx = ? "
                                        f"WHERE work_key = ? AND state = 'decided'{same} RETURNING work_key",
                                        (t, tx_hash, key) + (() if outcome is None else (outcome,))))
            _tally(db, {"state:decided": -moved, "state:reported": moved})

    def counts(self) -> dict[str, int]:
        """Rows per state and per outcome (for /metrics and the audit), from the tallies: no scan."""
        return {kind: int(n) for kind, n in self._db.execute(
            "SELECT kind, n FROM tallies WHERE n <> 0 AND (kind LIKE ? OR kind LIKE ?) ORDER BY kind",
            ("state:%", "outcome:%"))}

    def audit_counts(self) -> dict[str, int]:
        """The audit's `counts` (received = accepted + rejected_hard + rejected_soft + pending) from the tallies:
        no scan, so dashboards may poll it."""
        c = self.counts()
        received = sum(n for kind, n in c.items() if kind.startswith("state:"))
        return {"received": received, "accepted": c.get("outcome:accepted", 0),
                "rejected_hard": c.get("outcome:rejected_hard", 0), "rejected_soft": c.get("outcome:rejected_soft", 0),
                "pending": c.get("state:received", 0), "unreportable": c.get("state:unreportable", 0)}

    def audit(self) -> dict[str, Any]:
        """This validator's side of the audit (`GET /v1/audit`): row counts (received = accepted +
        rejected_hard + rejected_soft + pending), and per row kind the work keys an auditor reconciles
        with the chain and the trainer: accepted (node, units, feed seq, chain tx), hard (reason,
        evidence hash, whether the evidence is stored) and soft (reason); accepted rows carry `decided_at` (unix
        time: how long one has waited in the outbox); and `restored`: work whose hard verdict
        (another validator's) this validator overturned on appeal, with its feed seq (it is trained too). A verdict
        that can never land on chain is listed `reported: false` with `unreportable` (the revert that said so)."""
        rows = self._db.execute("SELECT work_key, node, state, outcome, reason, measurements, evidence_hash, "
                                "chain_tx, report_error, decided_at FROM submissions ORDER BY received_at, work_key")
        # after the rows: an accepted row entered the feed (and its evidence was stored) in its own transaction
        feed = {k: int(s) for s, k in self._db.execute("SELECT seq, work_key FROM feed")}
        stored = {h for (h,) in self._db.execute("SELECT hash FROM evidence")}
        accepted, hard, soft = [], [], []
        per_node: dict[str, dict[str, Any]] = {}
        ties: dict[str, list[int]] = {}  # node -> [paid tokens, near-ties, EOS near-ties] of its accepted work
        pending = unreportable = 0
        for key, node, state, outcome, reason, measurements, evidence_hash, tx, report_error, decided_at in rows:
            counts = per_node.setdefault(node, {"received": 0, "accepted": 0, "rejected_hard": 0,
                                                "rejected_soft": 0, "pending": 0})
            counts["received"] += 1
            if outcome is None:
                pending += 1
                counts["pending"] += 1
                continue
            counts[outcome] = counts.get(outcome, 0) + 1
            reported = state == "reported"
            extra = {"unreportable": report_error} if state == "unreportable" else {}
            unreportable += bool(extra)
            if outcome == "accepted":
                m = Measurements.from_json(json.loads(measurements or "{}"))
                units = m.units or 1
                count_ties(ties.setdefault(node, [0, 0, 0]), m)
                accepted.append({"work_key": key, "node": node, "units": units, "feed_seq": feed.get(key),
                                 "reported": reported, "chain_tx": tx, "decided_at": decided_at, **extra})
            elif outcome == "rejected_hard":
                hard.append({"work_key": key, "node": node, "reason": reason, "evidence_hash": evidence_hash,
                             "evidence_stored": evidence_hash in stored, "reported": reported, "chain_tx": tx,
                             **extra})
            else:
                soft.append({"work_key": key, "node": node, "reason": reason, "reported": reported,
                             "chain_tx": tx, **extra})
        # work this validator restored by overturning another's hard verdict: fed to the trainer like accepted work
        restored = [{"work_key": key, "node": node, "units": int(units), "feed_seq": feed.get(key),
                     "resolved": resolved is not None, "chain_tx": tx}
                    for key, node, units, resolved, tx in self._db.execute(
                        "SELECT work_key, node, units, resolved_at, chain_tx FROM appeals WHERE outcome = 'overturned' "
                        "ORDER BY received_at, work_key")]
        for node, (tokens, near, near_eos) in ties.items():
            per_node[node]["near_ties"] = {"tokens": tokens, "near_ties": near, "eos_near_ties": near_eos,
                                           "per_1k_tokens": round(1000 * near / tokens, 3) if tokens else None}
        return {
            "near_tie_review": near_tie_review(ties),
            "counts": {"received": sum(c["received"] for c in per_node.values()), "accepted": len(accepted),
                       "rejected_hard": len(hard), "rejected_soft": len(soft), "pending": pending,
                       "unreportable": unreportable},
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
        refused = self.refusals(node)
        holes = self._db.execute("SELECT COALESCE(SUM(holes), 0) FROM counter_holes WHERE node = ?", (node,))
        return {"node": node, "verdicts": verdicts, "pending": int(pending[0][0]), "refused": refused,
                "counter_holes": int(holes[0][0]), "stored_bytes": self.node_stored_bytes(node)}

    def drift_failures_since(self, policy_version: int, since: float) -> list[str]:
        """Distinct nodes with a hard verdict in the drift band (`validator.guard.drift_band`) at
        `policy_version` decided since `since`. Softened rows (`suspected_systemic`) never count again."""
        return [n for (n,) in self._db.execute(
            "SELECT DISTINCT node FROM submissions WHERE policy_version = ? AND decided_at >= ? AND "
            "outcome = 'rejected_hard' AND measurements LIKE ?", (policy_version, since, _DRIFT_MARK))]

    def active_nodes_since(self, since: float) -> list[str]:
        return [n for (n,) in self._db.execute(
            "SELECT DISTINCT node FROM submissions WHERE received_at >= ?", (since,))]

    def accepted_before(self, nodes: Sequence[str], before: float) -> dict[str, int]:
        """Accepted submissions per node decided before `before` (the guard's history weight)."""
        out: dict[str, int] = {}
        for at in range(0, len(nodes), 500):
            chunk = list(nodes[at : at + 500])
            marks = ", ".join("?" for _ in chunk)
            for node, n in self._db.execute(
                    f"SELECT node, COUNT(*) FROM submissions WHERE node IN ({marks}) AND outcome = 'accepted' AND "
                    "decided_at < ? GROUP BY node", [*chunk, before]):
                out[node] = int(n)
        return out

    def random_accepted(self, policy_version: int, limit: int, *, excluding: Sequence[str] = ()) -> list[Row]:
        """Up to `limit` accepted submissions of `policy_version` drawn at random (the database's own random,
        seeded from the OS), none by a node in `excluding`: the guard's known-good work, which the nodes it
        suspects can neither choose nor time."""
        marks = ", ".join("?" for _ in excluding)
        skip = f" AND node NOT IN ({marks})" if excluding else ""
        return self._rows(f"WHERE policy_version = ? AND outcome = 'accepted' AND LENGTH(envelope) > 0{skip} "
                          "ORDER BY RANDOM() LIMIT ?", (policy_version, *excluding, limit))

    def prune_envelopes(self, *, reported_before: float, limit: int = 1000) -> int:
        """Drop the stored envelope of up to `limit` rows that went on chain (or left the outbox) before
        `reported_before`, the chain's invalidation window ago: their verdict can no longer change on chain, so
        the bytes only fill the disk. Hard verdicts keep theirs (the evidence names the envelope by its hash
        and an appeal may still cite it); the row, its verdict and measurements stay. Returns how many."""
        with self._db.transaction() as db:
            rows = db.execute(
                "SELECT work_key, node, LENGTH(envelope) FROM submissions WHERE state IN ('reported', 'unreportable') "
                f"AND outcome <> 'rejected_hard' AND reported_at < ? AND LENGTH(envelope) > 0 LIMIT ?{db.for_update}",
                (reported_before, limit))
            freed: dict[str, int] = {}
            for key, node, size in rows:
                db.execute("UPDATE submissions SET envelope = ? WHERE work_key = ?", (b"", key))
                freed[node] = freed.get(node, 0) + int(size)
            for node in sorted(freed):
                _add_node_bytes(db, node, -freed[node])
        return len(rows)

    def node_stored_bytes(self, node: str) -> int:
        """Bytes of `node`'s envelopes stored here and not pruned (a total, kept across restarts)."""
        rows = self._db.execute("SELECT stored FROM node_bytes WHERE node = ?", (node,))
        return int(rows[0][0]) if rows else 0

    # -- counters in order (docs/protocol/assignment.md, "Counters") -------------------------------------------

    def next_counter(self, node: str, policy_version: int, *, base: int | None) -> int | None:
        """The smallest counter >= `base` with no row for (`node`, `policy_version`): the one this validator
        expects next. `base=None` (a validator that took the node over): from the smallest counter it holds,
        or None when it holds none yet (any counter may start)."""
        if base is None:
            lo = self._db.execute("SELECT MIN(counter) FROM submissions WHERE node = ? AND policy_version = ?",
                                  (node, policy_version))
            if lo[0][0] is None:
                return None
            base = int(lo[0][0])
        if not self._db.execute("SELECT 1 FROM submissions WHERE node = ? AND policy_version = ? AND counter = ?",
                                (node, policy_version, base)):
            return base
        # the first row >= base whose successor has no row ends the run of recorded counters
        rows = self._db.execute(
            "SELECT MIN(s.counter) FROM submissions s WHERE s.node = ? AND s.policy_version = ? AND s.counter >= ? "
            "AND NOT EXISTS (SELECT 1 FROM submissions t WHERE t.node = s.node AND "
            "t.policy_version = s.policy_version AND t.counter = s.counter + 1)", (node, policy_version, base))
        return int(rows[0][0]) + 1

    def uncounted_assignments(self, below_version: int, from_version: int = 0
                              ) -> list[tuple[str, int, int, int, int]]:
        """(node, version, smallest counter, largest counter, distinct counters) of every (node, version) with
        `from_version <= version < below_version` that has rows taken inside the async window (stale ones do
        not count) and no hole count yet."""
        return [(str(n), int(v), int(lo), int(hi), int(k)) for n, v, lo, hi, k in self._db.execute(
            "SELECT s.node, s.policy_version, MIN(s.counter), MAX(s.counter), COUNT(DISTINCT s.counter) "
            "FROM submissions s WHERE s.policy_version >= ? AND s.policy_version < ? "
            "AND (s.reason IS NULL OR s.reason <> 'stale_version') AND NOT EXISTS (SELECT 1 FROM counter_holes h "
            "WHERE h.node = s.node AND h.policy_version = s.policy_version) GROUP BY s.node, s.policy_version",
            (from_version, below_version))]

    def record_holes(self, node: str, policy_version: int, first: int, last: int, holes: int, *,
                     now: float | None = None) -> bool:
        """Count (once) the assignments `node` skipped at `policy_version` between `first` and `last`."""
        t = time.time() if now is None else now
        return bool(self._db.execute(
            "INSERT INTO counter_holes (node, policy_version, first_counter, last_counter, holes, counted_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING node",
            (node, policy_version, first, last, holes, t)))

    def holes_since(self, node: str, from_version: int) -> int:
        """Assignments `node` skipped here at versions `from_version` and later (as counted by `record_holes`)."""
        rows = self._db.execute("SELECT COALESCE(SUM(holes), 0) FROM counter_holes WHERE node = ? AND "
                                "policy_version >= ?", (node, from_version))
        return int(rows[0][0])

    def counter_holes(self) -> dict[str, int]:
        """Per node with any: assignments skipped (never submitted here inside their window), all versions."""
        return {str(n): int(h) for n, h in self._db.execute(
            "SELECT node, SUM(holes) FROM counter_holes GROUP BY node HAVING SUM(holes) > 0")}

    def node_holes(self, node: str, from_version: int) -> dict[int, int]:
        """{version: holes} of `node` here at versions `from_version` and later (those with any)."""
        return {int(v): int(h) for v, h in self._db.execute(
            "SELECT policy_version, holes FROM counter_holes WHERE node = ? AND policy_version >= ? AND holes > 0",
            (node, from_version))}

    # -- what the pool's other validators are told (`validator.notes`) ---------------------------

    def hard_pending_nodes(self, *, reported_since: float, limit: int, keys_per_node: int
                           ) -> list[tuple[str, int, float, list[str]]]:
        """(node, count, oldest decision time, the oldest `keys_per_node` work keys) of at most `limit` nodes with a
        hard verdict here not on chain yet, or reported since `reported_since` (`hard_pending`'s rule), oldest
        first. One scan of the pending hard rows (few: each holds its node back)."""
        rows = self._db.execute(
            "SELECT node, work_key, decided_at FROM submissions WHERE outcome = 'rejected_hard' AND (state = 'decided' "
            "OR (state = 'reported' AND reported_at >= ?)) ORDER BY decided_at, work_key", (reported_since,))
        out: dict[str, tuple[int, float, list[str]]] = {}
        for node, key, decided in rows:
            n, oldest, keys = out.get(node, (0, float(decided), []))
            if len(keys) < keys_per_node:
                keys.append(str(key))
            out[node] = (n + 1, oldest, keys)
        return [(node, n, oldest, keys) for node, (n, oldest, keys) in list(out.items())[:limit]]

    def holes_of_nodes(self, from_version: int) -> dict[str, dict[int, int]]:
        """{node: {version: holes}} of every node with holes counted here at versions `from_version` and later."""
        out: dict[str, dict[int, int]] = {}
        for node, version, holes in self._db.execute(
                "SELECT node, policy_version, holes FROM counter_holes WHERE policy_version >= ? AND holes > 0",
                (from_version,)):
            out.setdefault(str(node), {})[int(version)] = int(holes)
        return out

    def near_tie_accounts(self, limit: int) -> dict[str, tuple[int, int, int]]:
        """{node: (paid tokens, near-ties, EOS near-ties)} of the accepted work here, the `limit` nodes with the most
        near-ties (then the most tokens)."""
        return {str(n): (int(t), int(k), int(e)) for n, t, k, e in self._db.execute(
            "SELECT node, tokens, near_ties, eos_near_ties FROM node_ties WHERE tokens > 0 OR near_ties > 0 "
            "ORDER BY near_ties DESC, tokens DESC, node LIMIT ?", (limit,))}

    def near_tie_nodes(self) -> int:
        """How many nodes have a near-tie account here."""
        return int(self._db.execute("SELECT COUNT(*) FROM node_ties WHERE tokens > 0 OR near_ties > 0")[0][0])

    def near_tie_account(self, node: str) -> tuple[int, int, int]:
        """(paid tokens, near-ties, EOS near-ties) of `node`'s accepted work here (kept by `_decide`: no scan)."""
        rows = self._db.execute("SELECT tokens, near_ties, eos_near_ties FROM node_ties WHERE node = ?", (node,))
        return (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else (0, 0, 0)

    # -- refusals (requests that never became a row, counted per signed sender) ------------------

    def count_refusal(self, node: str, reason: str, *, now: float | None = None) -> None:
        """One more refused request of `node` for `reason`, counted in memory until `flush_refusals` (the service's
        loop, every `validator.service.REFUSALS_FLUSH_S`, and `close`). A write per refusal was a synchronous commit per refused
        request, and a flood of them (a staked key's stale work, ~40 a second) held the ledger's one connection
        between the honest rows' reads and writes; a crash loses at most the last interval's counts."""
        t = time.time() if now is None else now
        with self._refusals_lock:
            count, last = self._refusals.get((node, reason), (0, t))
            self._refusals[(node, reason)] = (count + 1, max(last, t))

    def flush_refusals(self) -> int:
        """Write the refusals counted since the last flush, in one transaction; returns how many (node, reason)
        totals changed. On a `LedgerError` the counts stay in memory for the next flush."""
        with self._refusals_lock:
            pending, self._refusals = self._refusals, {}
        if not pending:
            return 0
        try:
            with self._db.transaction() as db:
                for (node, reason), (count, last) in sorted(pending.items()):
                    db.execute(
                        "INSERT INTO refusals (node, reason, count, last_at) VALUES (?, ?, ?, ?) ON CONFLICT (node, "
                        "reason) DO UPDATE SET count = refusals.count + excluded.count, last_at = excluded.last_at",
                        (node, reason, count, last))
        except LedgerError:
            with self._refusals_lock:  # counted again on the next flush, with what came meanwhile
                for k, (count, last) in pending.items():
                    now_count, now_last = self._refusals.get(k, (0, last))
                    self._refusals[k] = (now_count + count, max(now_last, last))
            raise
        return len(pending)

    def refusals(self, node: str) -> dict[str, int]:
        """`node`'s refused requests by reason: the written totals and those not flushed yet."""
        refused = {str(r): int(n) for r, n in self._db.execute(
            "SELECT reason, count FROM refusals WHERE node = ?", (node,))}
        with self._refusals_lock:
            for (who, reason), (count, _) in self._refusals.items():
                if who == node:
                    refused[reason] = refused.get(reason, 0) + count
        return refused

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
        rows = self._db.execute("SELECT n FROM tallies WHERE kind = 'feed'")
        return int(rows[0][0]) if rows else 0

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
                if db.execute("INSERT INTO feed (work_key, created_at, item) VALUES (?, ?, ?) ON CONFLICT DO NOTHING "
                              "RETURNING seq", (row.work_key, row.received_at, feed_item)):
                    _tally(db, {"feed": 1})
        return True

    def withdraw_feed(self, work_key: str) -> bool:
        """Take a work key's item out of the feed (a restoration the chain settled the other way); True if it was
        there. A trainer that fetched it already, or a Parquet file already written, cannot be called back."""
        with self._db.transaction() as db:
            gone = bool(db.execute("DELETE FROM feed WHERE work_key = ? RETURNING work_key", (work_key,)))
            if gone:
                _tally(db, {"feed": -1})
        return gone

    def unresolved_appeals(self, limit: int) -> list[AppealRow]:
        """Decided appeals not yet resolved on chain, oldest first."""
        return [AppealRow(*r) for r in self._db.execute(
            f"SELECT {_APPEAL_COLUMNS} FROM appeals WHERE resolved_at IS NULL ORDER BY received_at LIMIT ?",
            (limit,))]

    def mark_appeal_resolved(self, work_key: str, tx_hash: str | None, *, now: float | None = None) -> None:
        self._db.execute("UPDATE appeals SET resolved_at = ?, chain_tx = ? WHERE work_key = ? AND resolved_at IS NULL",
                         (time.time() if now is None else now, tx_hash, work_key))


_TALLIES_MARK = "tallies:v1"
_TIES_MARK = "node_ties:v1"
"""Set once the `node_ties` accounts hold every accepted row (a ledger older than them is counted at open)."""


def _add_ties(db: _Db, node: str, m: Measurements, sign: int) -> None:
    """Inside the transaction that decides a row: add (`sign` 1) or take back (-1) its near-tie account."""
    acc = [0, 0, 0]
    count_ties(acc, m)
    if any(acc):
        db.execute("INSERT INTO node_ties (node, tokens, near_ties, eos_near_ties) VALUES (?, ?, ?, ?) ON CONFLICT "
                   "(node) DO UPDATE SET tokens = node_ties.tokens + excluded.tokens, near_ties = node_ties.near_ties "
                   "+ excluded.near_ties, eos_near_ties = node_ties.eos_near_ties + excluded.eos_near_ties",
                   (node, *(sign * x for x in acc)))


def _ties_from_rows(db: _Db) -> None:
    """Inside the schema transaction: the near-tie accounts of the accepted rows as they are (once)."""
    db.execute("DELETE FROM node_ties")
    for node, measurements in db.execute("SELECT node, measurements FROM submissions WHERE outcome = 'accepted' "
                                         "AND measurements IS NOT NULL"):
        _add_ties(db, str(node), Measurements.from_json(json.loads(measurements)), 1)
    _tally(db, {_TIES_MARK: 1})


def _add_node_bytes(db: _Db, node: str, n: int) -> None:
    db.execute("INSERT INTO node_bytes (node, stored) VALUES (?, ?) ON CONFLICT (node) DO UPDATE SET "
               "stored = node_bytes.stored + excluded.stored", (node, n))


def _tally(db: _Db, change: dict[str, int]) -> None:
    """Inside the transaction that changes the rows: add `change` to the tallies."""
    for kind, n in sorted(change.items()):  # one order: two writers never wait on each other's rows crosswise
        if n:
            db.execute("INSERT INTO tallies (kind, n) VALUES (?, ?) ON CONFLICT (kind) DO UPDATE SET "
                       "n = tallies.n + excluded.n", (kind, n))


def _count_from_rows(db: _Db) -> None:
    """Inside the schema transaction: the tallies of the rows as they are (once, for a ledger that predates them)."""
    db.execute("DELETE FROM tallies")
    change: dict[str, int] = {_TALLIES_MARK: 1}
    for state, n in db.execute("SELECT state, COUNT(*) FROM submissions GROUP BY state"):
        change[f"state:{state}"] = int(n)
    for outcome, n in db.execute("SELECT outcome, COUNT(*) FROM submissions WHERE outcome IS NOT NULL GROUP BY outcome"):
        change[f"outcome:{outcome}"] = int(n)
    change["feed"] = int(db.execute("SELECT COUNT(*) FROM feed")[0][0])
    _tally(db, change)


NEAR_TIE_REVIEW_MIN = 10
"""Near-ties a node's accepted work must hold before its rate is compared with the fleet's."""
NEAR_TIE_REVIEW_FACTOR = 5.0
"""A node is listed for review when its near-ties per paid token exceed this many times the fleet's median."""


@dataclass(frozen=True)
class NearTieAccount:
    """A node's accepted work on one validator, as the near-tie rule counts it (`Ledger.near_tie_account`)."""

    tokens: int
    """Paid tokens."""
    near_ties: int
    """Near-tie disagreements among them."""
    rows: tuple[tuple[str, int, int], ...] = ()
    """(work key, paid tokens, near-ties) of each accepted row holding near-ties, oldest first."""

    def plus(self, work_key: str, m: Measurements) -> NearTieAccount:
        """The account with one more row (the submission being judged) counted."""
        acc = [self.tokens, self.near_ties, 0]
        count_ties(acc, m)
        rows = self.rows + (((work_key, acc[0] - self.tokens, acc[1] - self.near_ties),)
                            if acc[1] > self.near_ties else ())
        return NearTieAccount(tokens=acc[0], near_ties=acc[1], rows=rows)


def count_ties(acc: list[int], m: Measurements) -> None:
    """Add one accepted row's measurements to [paid tokens, near-ties, EOS near-ties]."""
    acc[0] += sum(s.paid_tokens or 0 for s in m.samples)
    acc[1] += m.near_ties or 0
    acc[2] += m.eos_near_ties or 0


def near_tie_review(ties: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Nodes whose accepted work disagrees with the replay at near-ties far more often than the fleet's does.

    A near-tie disagreement (the replay's winner within the sampling margin, not the node's token) passes every
    check: honest float drift flips one now and then and whatever the token, so no single one is evidence. A node
    that picks among near-ties on purpose (to steer what the trainer learns) flips them every time it gains, so
    its rate stands out against the fleet's median: at least `NEAR_TIE_REVIEW_MIN` near-ties and more than
    `NEAR_TIE_REVIEW_FACTOR` times the median rate. A listing costs nothing on chain (nodes of another dtype than
    most of the fleet drift more, honestly): it is for an operator to look at, worst first."""
    rates = sorted(near / tokens for tokens, near, _ in ties.values() if tokens)
    if not rates:
        return []
    median = rates[len(rates) // 2] if len(rates) % 2 else (rates[len(rates) // 2 - 1] + rates[len(rates) // 2]) / 2
    out = [{"node": node, "near_ties": near, "eos_near_ties": near_eos, "tokens": tokens,
            "per_1k_tokens": round(1000 * near / tokens, 3), "fleet_median_per_1k_tokens": round(1000 * median, 3)}
           for node, (tokens, near, near_eos) in ties.items()
           if tokens and near >= NEAR_TIE_REVIEW_MIN and near / tokens > NEAR_TIE_REVIEW_FACTOR * median]
    return sorted(out, key=lambda r: -r["per_1k_tokens"])
