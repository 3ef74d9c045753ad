"""The chain reporter: drains decided ledger rows onto the pool contract, idempotently.

- accepted work: `recordWorkBatch` (the contract skips keys it already knows, so a batch resent after
  an unknown outcome records nothing twice);
- hard verdicts: `invalidateHard(node, key, reason, evidenceHash)`, but only once they are older than
  the systemic window (`systemic.window_s`), so a wave of failures that turns out to be our own fault
  is softened before anyone is slashed;
- stale work: `invalidateSoft` (never paid, never slashed);
- every other soft verdict (not ours to check, our own failure) stays off chain: the assignment is
  not burnt for a fault that is not the node's.

A failed transaction leaves its rows `decided`; the next round retries them. Before retrying a row
the reporter reads the key's status on chain, so a transaction that landed but whose receipt was lost
counts as done.
"""

from __future__ import annotations

import logging
import threading
import time

from contracts.pool import PoolClient, WorkStatus
from protocol.errors import ChainError
from protocol.rollout import Outcome, Reason
from validator.ledger import Ledger, Row

log = logging.getLogger(__name__)

_ACCEPTED = Outcome.ACCEPTED.value
_ON_CHAIN_SOFT = {Reason.STALE_VERSION.value}
_TRANSIENT = {"http", "timeout", "unreachable", None}
"""`ChainError.reason`s that say nothing about the items: the whole batch is retried later."""
_NEVER = {"NodeNotActive", "ZeroUnits"}
"""Reverts of a one-item batch that no retry can fix."""


class Reporter:
    def __init__(self, ledger: Ledger, pool: PoolClient | None, *, batch: int, hold_hard_s: float) -> None:
        self.ledger = ledger
        self.pool = pool
        self.batch = batch
        self.hold_hard_s = hold_hard_s
        self.reported = 0
        self.failures = 0
        self._lock = threading.Lock()

    def _done_on_chain(self, row: Row, *done: WorkStatus) -> bool:
        """Whether the chain already shows `row`'s action (a transaction that landed, receipt lost)."""
        if self.pool is None:
            return False
        try:
            return self.pool.get_work(row.work_key).status in done
        except ChainError:
            return False

    def drain(self, now: float | None = None) -> int:
        """One round; returns the number of rows marked reported."""
        with self._lock:
            t = time.time() if now is None else now
            rows = self.ledger.unreported(10 * self.batch)
            done = 0
            accepted: list[Row] = []
            for row in rows:
                if row.outcome == Outcome.ACCEPTED.value:
                    accepted.append(row)
                elif row.outcome == Outcome.REJECTED_HARD.value:
                    if row.decided_at is not None and t - row.decided_at < self.hold_hard_s:
                        continue
                    done += self._invalidate(row, hard=True)
                elif row.reason in _ON_CHAIN_SOFT and self.pool is not None:
                    done += self._invalidate(row, hard=False)
                else:
                    self.ledger.mark_reported([row.work_key], None, outcome=row.outcome)
                    done += 1
            for i in range(0, len(accepted), self.batch):
                done += self._record(accepted[i : i + self.batch])
            self.reported += done
            return done

    def _record(self, rows: list[Row]) -> int:
        if self.pool is None:
            self.ledger.mark_reported([r.work_key for r in rows], None, outcome=_ACCEPTED)
            return len(rows)
        items: list[tuple[str, bytes | str, int]] = [(r.node, r.work_key, _units(r)) for r in rows]
        try:
            receipt = self.pool.record_work_batch(items)
        except ChainError as exc:
            self.failures += 1
            log.warning("recordWorkBatch of %d keys failed: %s", len(rows), exc)
            landed = [r for r in rows if self._done_on_chain(r, WorkStatus.ACCEPTED, WorkStatus.CLAIMED)]
            self.ledger.mark_reported([r.work_key for r in landed], None, outcome=_ACCEPTED)
            if len(rows) > 1 and exc.reason not in _TRANSIENT:  # one bad item must not block the rest
                rest = [r for r in rows if r not in landed]
                return len(landed) + sum(self._record([r]) for r in rest)
            if len(rows) == 1 and not landed and exc.reason in _NEVER:
                # e.g. the node left or was ejected after we accepted: it can no longer be paid
                log.error("accepted %s of %s can never be recorded (%s); kept in the ledger and the feed",
                          rows[0].work_key, rows[0].node, exc.reason)
                self.ledger.mark_reported([rows[0].work_key], f"refused:{exc.reason}", outcome=_ACCEPTED)
                return 1
            return len(landed)
        self.ledger.mark_reported([r.work_key for r in rows], receipt.tx_hash, outcome=_ACCEPTED)
        log.info("recorded %d accepted submissions on chain (tx %s)", len(rows), receipt.tx_hash)
        return len(rows)

    def _invalidate(self, row: Row, *, hard: bool) -> int:
        assert self.pool is not None or not hard
        if self.pool is None:
            self.ledger.mark_reported([row.work_key], None, outcome=row.outcome)
            return 1
        code = Reason(str(row.reason)).code
        try:
            if hard:
                assert row.evidence_hash is not None, "a hard verdict always has evidence"
                receipt = self.pool.invalidate_hard(row.node, row.work_key, code, row.evidence_hash)
            else:
                receipt = self.pool.invalidate_soft(row.node, row.work_key, code)
        except ChainError as exc:
            if self._done_on_chain(row, WorkStatus.HARD_INVALIDATED if hard else WorkStatus.SOFT_INVALIDATED):
                self.ledger.mark_reported([row.work_key], None, outcome=row.outcome)
                return 1
            self.failures += 1
            log.warning("invalidate%s %s failed (will retry): %s", "Hard" if hard else "Soft", row.work_key, exc)
            return 0
        self.ledger.mark_reported([row.work_key], receipt.tx_hash, outcome=row.outcome)
        log.info("invalidated%s %s of %s (%s) on chain, tx %s", " and slashed" if hard else "", row.work_key,
                 row.node, row.reason, receipt.tx_hash)
        return 1


def _units(row: Row) -> int:
    import json

    measurements = json.loads(row.measurements or "{}")
    return int(measurements.get("units", 1))
