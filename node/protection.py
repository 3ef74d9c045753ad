"""The slashing-protection database: every assignment this node's key has signed, and with what payload.

An assignment is (run, node, policy version, counter); the validator pays it at most once and slashes
a key that signs two different payloads for it (`equivocation`). So before the node signs, it
records the assignment with the SHA-256 of the payload's canonical JSON (`payload_hash`); a second,
different payload for a recorded assignment raises `DoubleSignError` instead of being signed. The
same payload may be sealed again (a retry with a fresh nonce is not equivocation). The payload itself
is kept until its verdict arrives, so a restart resubmits work instead of losing it; the worker marks a
record `decided` (dropping the payload) only for a verdict it verified as its validator's signature
about one of the envelopes kept in `sent` (`sent_hashes`), never for an answer's say-so.

For appeals the record also keeps every envelope sent (`sent`, until its assignment's verdict is known)
and each hard verdict as the validator signed it (`hard_verdicts`, with the envelope it judged, for as
long as the file lives): `prime-node appeal` sends both to another validator.

The record survives crashes (SQLite, WAL, one transaction per record) and travels with the key:
`export()`/`import_()` write and read the interchange format below, modelled on Ethereum's EIP-3076.

Interchange format, version 1 (JSON; integers as decimal strings, as in EIP-3076)::

    {
      "metadata": {"interchange_format": "prime-slashing-protection", "interchange_format_version": "1"},
      "data": [
        {"node": "0x<EIP-55 address>", "run_id": "<run>",
         "signed": [{"policy_version": "1", "counter": "0", "payload_hash": "0x<64 hex>"}]}
      ]
    }

Import merges: a record already present with the same hash is a no-op; one with a different hash
means the key has already signed two payloads somewhere, and the whole import is refused
(`ProtectionImportError`) before anything is written. Imported records carry no payload: the node
never signs those assignments again and moves on to a fresh counter.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from node.errors import DoubleSignError, ProtectionImportError
from protocol.canonical import canonical_bytes
from protocol.episodes import AnySubmission, EpisodeSubmission
from protocol.errors import PrimeError
from protocol.identity import checksum
from protocol.rollout import Submission

FORMAT = "prime-slashing-protection"
FORMAT_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS signed (
    run_id TEXT NOT NULL,
    node TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    payload_hash TEXT NOT NULL,
    payload TEXT,
    state TEXT NOT NULL DEFAULT 'signed',
    signed_at REAL NOT NULL,
    PRIMARY KEY (run_id, node, policy_version, counter)
);
"""

_SCHEMA_APPEALS = """
CREATE TABLE IF NOT EXISTS sent (
    submission_hash TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    node TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    envelope TEXT NOT NULL,
    sent_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sent_assignment ON sent (run_id, node, policy_version, counter);
CREATE TABLE IF NOT EXISTS hard_verdicts (
    work_key TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    node TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    reason TEXT NOT NULL,
    validator TEXT NOT NULL,
    submission_hash TEXT NOT NULL,
    verdict TEXT NOT NULL,
    submission TEXT,
    received_at REAL NOT NULL,
    appeal TEXT
);
"""

STATES = ("signed", "submitted", "decided", "imported", "refused")
"""`refused`: its validator will not take it (counter out of order there); never resent, never signed again."""


def payload_hash(sub: AnySubmission) -> str:
    """The hex SHA-256 of a submission body's canonical JSON: what the protection record compares."""
    return "0x" + hashlib.sha256(canonical_bytes(sub.model_dump(mode="json"))).hexdigest()


@dataclass(frozen=True)
class HardVerdict:
    """A hard verdict against this node as its validator signed it, with the submission envelope it judged."""

    work_key: str
    run_id: str
    node: str
    policy_version: int
    counter: int
    reason: str
    validator: str
    """The validator that signed the verdict (and slashed)."""
    submission_hash: str
    verdict: str
    """The signed `Verdict` envelope (canonical JSON)."""
    submission: str | None
    """The judged `Submission` envelope as sent; None when this file never held it (e.g. imported)."""
    appeal: str | None
    """The last appeal answer (JSON), if any."""


@dataclass(frozen=True)
class Record:
    run_id: str
    node: str
    policy_version: int
    counter: int
    payload_hash: str
    payload: str | None
    state: str

    def submission(self) -> AnySubmission | None:
        if self.payload is None:
            return None
        try:  # the body's JSON names no version; the two versions' shapes never both validate (extra="forbid")
            return Submission.model_validate_json(self.payload)
        except ValidationError:
            return EpisodeSubmission.model_validate_json(self.payload)


class SlashingProtection:
    """The SQLite record (see the module docstring). Thread-safe; one file per node state dir."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a signature must never outlive its record
        self._db.executescript(_SCHEMA)
        self._db.executescript(_SCHEMA_APPEALS)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SlashingProtection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- signing --------------------------------------------------------------------------------

    def check_and_record(self, sub: AnySubmission) -> bool:
        """Record `sub` as signed before it is signed. True: new record; False: the same payload was
        recorded before (sealing it again is safe). `DoubleSignError` for a different payload."""
        digest = payload_hash(sub)
        node = checksum(sub.node)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT payload_hash FROM signed WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                    (sub.run_id, node, sub.policy_version, sub.counter)).fetchone()
                if row is not None:
                    self._db.execute("COMMIT")
                    if row[0] != digest:
                        raise DoubleSignError(
                            f"refusing to sign: assignment #{sub.counter} of {node} at v{sub.policy_version} "
                            f"(run {sub.run_id}) was already signed with payload {row[0]}, this one is {digest}")
                    return False
                self._db.execute(
                    "INSERT INTO signed (run_id, node, policy_version, counter, payload_hash, payload, state, "
                    "signed_at) VALUES (?, ?, ?, ?, ?, ?, 'signed', ?)",
                    (sub.run_id, node, sub.policy_version, sub.counter, digest, sub.model_dump_json(), time.time()))
                self._db.execute("COMMIT")
                return True
            except DoubleSignError:
                raise
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def mark(self, run_id: str, node: str, policy_version: int, counter: int, state: str) -> None:
        """Move a record along signed -> submitted -> decided, or to refused (both drop the payload)."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        with self._lock:
            self._db.execute(
                "UPDATE signed SET state=?, payload=CASE WHEN ? IN ('decided', 'refused') THEN NULL ELSE payload END "
                "WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                (state, state, run_id, checksum(node), policy_version, counter))

    # -- what was sent and what came back (for appeals) ------------------------------------------

    def record_sent(self, sub: AnySubmission, envelope: bytes) -> None:
        """Keep a sealed envelope before it is sent: a hard verdict names its SHA-256."""
        digest = "0x" + hashlib.sha256(envelope).hexdigest()
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO sent (submission_hash, run_id, node, policy_version, counter, envelope, "
                "sent_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (digest, sub.run_id, checksum(sub.node), sub.policy_version, sub.counter, envelope.decode(),
                 time.time()))

    def record_verdict(self, run_id: str, node: str, policy_version: int, counter: int, *, hard: bool,
                       verdict: str | None) -> None:
        """A verdict arrived: in one transaction the record moves to `decided` (its payload dropped) and, hard,
        the verdict is kept (signed, as received) with the envelope it judged; otherwise the assignment's sent
        envelopes are dropped (nothing to appeal). One transaction, because a crash between dropping the sent
        envelopes and deciding the record left a `submitted` record whose verdict named an envelope the node
        no longer held: after the restart it took the validator's true verdict for a lie and shunned it."""
        node = checksum(node)
        where = (run_id, node, policy_version, counter)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                keep_sent = False
                if hard and verdict:
                    try:
                        env = json.loads(verdict)
                        body = env["body"]
                        key, validator = str(body["work_key"]), checksum(env["signer"])
                        digest, reason = str(body["submission_hash"]), str(body["reason"])
                    except (ValueError, KeyError, TypeError, PrimeError):
                        keep_sent = True  # not a verdict envelope: nothing an appeal could use
                    else:
                        sent = self._db.execute("SELECT envelope FROM sent WHERE submission_hash=?",
                                                (digest,)).fetchone()
                        self._db.execute(
                            "INSERT OR IGNORE INTO hard_verdicts (work_key, run_id, node, policy_version, counter, "
                            "reason, validator, submission_hash, verdict, submission, received_at) VALUES "
                            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (key, *where, reason, validator, digest, verdict, sent[0] if sent else None, time.time()))
                if not keep_sent:
                    self._db.execute("DELETE FROM sent WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                                     where)
                self._db.execute("UPDATE signed SET state='decided', payload=NULL WHERE run_id=? AND node=? AND "
                                 "policy_version=? AND counter=?", where)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def sent_hashes(self, run_id: str, node: str, policy_version: int, counter: int) -> set[str]:
        """The SHA-256 (`0x` hex) of every envelope sent for one assignment still awaiting its verdict: a
        verdict counts only if it is about one of them."""
        with self._lock:
            rows = self._db.execute(
                "SELECT submission_hash FROM sent WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                (run_id, checksum(node), policy_version, counter)).fetchall()
        return {str(r[0]) for r in rows}

    def last_sent(self, run_id: str, node: str, policy_version: int, counter: int) -> tuple[bytes, float] | None:
        """The envelope last sent for one assignment still awaiting its verdict, and when it was (last) sent:
        what a resend sends again, byte for byte."""
        with self._lock:
            row = self._db.execute(
                "SELECT envelope, sent_at FROM sent WHERE run_id=? AND node=? AND policy_version=? AND counter=? "
                "ORDER BY sent_at DESC LIMIT 1", (run_id, checksum(node), policy_version, counter)).fetchone()
        return None if row is None else (str(row[0]).encode(), float(row[1]))

    def resent(self, envelope: bytes) -> None:
        """`envelope` was sent again now (its resend deadline starts over)."""
        digest = "0x" + hashlib.sha256(envelope).hexdigest()
        with self._lock:
            self._db.execute("UPDATE sent SET sent_at=? WHERE submission_hash=?", (time.time(), digest))

    def hard_verdicts(self, run_id: str, node: str) -> list[HardVerdict]:
        """The hard verdicts kept for `node` in `run_id`, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT work_key, run_id, node, policy_version, counter, reason, validator, submission_hash, "
                "verdict, submission, appeal FROM hard_verdicts WHERE run_id=? AND node=? ORDER BY received_at",
                (run_id, checksum(node))).fetchall()
        return [HardVerdict(*r) for r in rows]

    def record_appeal(self, work_key: str, answer: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("UPDATE hard_verdicts SET appeal=? WHERE work_key=?", (json.dumps(answer), work_key))

    # -- reading --------------------------------------------------------------------------------

    def get(self, run_id: str, node: str, policy_version: int, counter: int) -> Record | None:
        with self._lock:
            row = self._db.execute(
                "SELECT run_id, node, policy_version, counter, payload_hash, payload, state FROM signed "
                "WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                (run_id, checksum(node), policy_version, counter)).fetchone()
        return None if row is None else Record(*row)

    def next_counter(self, run_id: str, node: str, policy_version: int) -> int:
        """The first counter above every one recorded at this version (never a recorded one)."""
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(counter) FROM signed WHERE run_id=? AND node=? AND policy_version=?",
                (run_id, checksum(node), policy_version)).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def unfinished(self, run_id: str, node: str) -> list[Record]:
        """Signed or submitted records that still hold their payload (to resubmit or to poll)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT run_id, node, policy_version, counter, payload_hash, payload, state FROM signed "
                "WHERE run_id=? AND node=? AND state IN ('signed', 'submitted') AND payload IS NOT NULL "
                "ORDER BY policy_version, counter", (run_id, checksum(node))).fetchall()
        return [Record(*r) for r in rows]

    def counts(self, run_id: str, node: str) -> dict[str, int]:
        """Records per state (signed: not yet taken by a validator; submitted: taken, awaiting a verdict;
        decided); what the audit compares with the validators' ledgers."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM signed WHERE run_id=? AND node=? GROUP BY state",
                                    (run_id, checksum(node))).fetchall()
        out = dict.fromkeys(STATES, 0)
        out.update({str(state): int(n) for state, n in rows})
        return out

    # -- interchange ----------------------------------------------------------------------------

    def export(self, node: str | None = None) -> dict[str, Any]:
        """The record (of one node, or all) in the interchange format of the module docstring."""
        query = "SELECT node, run_id, policy_version, counter, payload_hash FROM signed"
        args: tuple[Any, ...] = ()
        if node is not None:
            query, args = query + " WHERE node=?", (checksum(node),)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY node, run_id, policy_version, counter", args).fetchall()
        groups: dict[tuple[str, str], list[dict[str, str]]] = {}
        for n, run, version, counter, digest in rows:
            groups.setdefault((n, run), []).append(
                {"policy_version": str(version), "counter": str(counter), "payload_hash": digest})
        return {
            "metadata": {"interchange_format": FORMAT, "interchange_format_version": FORMAT_VERSION},
            "data": [{"node": n, "run_id": run, "signed": signed} for (n, run), signed in groups.items()],
        }

    def import_(self, data: Any) -> int:
        """Merge an interchange document; returns how many records were new. See the module docstring."""
        records = _parse_interchange(data)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                new, conflicts = [], []
                for rec in records:
                    row = self._db.execute(
                        "SELECT payload_hash FROM signed WHERE run_id=? AND node=? AND policy_version=? AND counter=?",
                        rec[:4]).fetchone()
                    if row is None:
                        new.append(rec)
                    elif row[0] != rec[4]:
                        conflicts.append(rec)
                if conflicts:
                    run, node, version, counter, _ = conflicts[0]
                    raise ProtectionImportError(
                        f"{len(conflicts)} imported record(s) conflict with this database (e.g. {node} v{version} "
                        f"#{counter} in run {run}): the key already signed two payloads; nothing imported")
                now = time.time()
                self._db.executemany(
                    "INSERT INTO signed (run_id, node, policy_version, counter, payload_hash, payload, state, "
                    "signed_at) VALUES (?, ?, ?, ?, ?, NULL, 'imported', ?)", [(*r, now) for r in new])
                self._db.execute("COMMIT")
                return len(new)
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise


def _parse_interchange(data: Any) -> list[tuple[str, str, int, int, str]]:
    """(run_id, node, version, counter, payload_hash) of every record; `ProtectionImportError` if malformed."""
    try:
        meta = data["metadata"]
        if meta["interchange_format"] != FORMAT or str(meta["interchange_format_version"]) != FORMAT_VERSION:
            raise ProtectionImportError(
                f"not a {FORMAT} v{FORMAT_VERSION} document: {meta.get('interchange_format')!r} "
                f"v{meta.get('interchange_format_version')!r}")
        out = []
        for entry in data["data"]:
            node, run = checksum(entry["node"]), entry["run_id"]
            if not isinstance(run, str) or not run:
                raise ProtectionImportError(f"bad run_id {run!r}")
            for s in entry["signed"]:
                version, counter = int(str(s["policy_version"])), int(str(s["counter"]))
                digest = str(s["payload_hash"]).lower()
                if version < 0 or counter < 0:
                    raise ProtectionImportError("negative policy_version or counter")
                if len(digest) != 66 or not digest.startswith("0x") or not _is_hex(digest[2:]):
                    raise ProtectionImportError(f"bad payload_hash {digest!r}")
                out.append((run, node, version, counter, digest))
        return out
    except ProtectionImportError:
        raise
    except (KeyError, TypeError, ValueError, PrimeError) as exc:
        raise ProtectionImportError(f"malformed interchange document: {exc!r}") from exc


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def load_document(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProtectionImportError(f"cannot read {path}: {exc}") from exc
