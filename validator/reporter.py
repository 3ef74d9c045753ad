"""The chain reporter: drains decided ledger rows onto the pool contract, idempotently.

- accepted work: `recordWorkBatch` (the contract skips keys it already knows, so a batch resent after
  an unknown outcome records nothing twice);
- hard verdicts: `invalidateHardBatch` (each slashed as by `invalidateHard(node, key, reason, evidenceHash)`,
  one transaction per batch), but only once they are older than
  the systemic window (`systemic.window_s`), so a wave of failures that turns out to be our own fault
  is softened before anyone is slashed;
- stale work: `invalidateSoftBatch`, one transaction per batch (never paid, never slashed; idempotent
  like `recordWorkBatch`). Intake refuses stale work without a row now, so only rows of an older ledger
  get here;
- every other soft verdict (not ours to check, our own failure) stays off chain: the assignment is
  not burnt for a fault that is not the node's.

One row never holds up the others. The outbox is read by kind, one page at a time, without envelopes
(`Ledger.outbox`), and a failure is classified once:

- the RPC failing (unreachable, timeout, HTTP error): nothing is wrong with the rows; the round stops
  and the next one waits, doubling from `retry_backoff_s` up to `max_backoff_s`;
- a revert no retry can change (`PERMANENT`: the invalidation window closed, the work is not accepted
  any more, it is another node's, the node can no longer be paid...): the row leaves the outbox as
  `unreportable`, with the revert as its reason, counted in `unreportable` (metric
  `prime_validator_unreportable`) and logged. This is what a node that re-signs old, recorded work gets:
  its equivocation verdict is kept as evidence, never retried forever;
- any other revert (the reward budget is spent, the pool is paused, our role was revoked): that row waits
  (`Ledger.defer_report`, the same doubling backoff per row) while the rows behind it are reported;
- a batch that reverts is sent again row by row, so one bad row is set aside and the rest land.

Before giving up on a row the reporter reads the key's status on chain, so a transaction that landed but
whose receipt was lost counts as done. A transaction the chain drops or leaves pending is sent again by the
transactor while the reporter waits; one rolled back with its block after the rows were marked reported is
sent again at the start of the next round (`Transactor.reconcile`), and the contract's keys make every copy
after the first record nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from contracts.pool import PoolClient, WorkStatus
from protocol.errors import ChainError
from protocol.rollout import Outcome, Reason
from validator.ledger import Ledger, OutboxRow

log = logging.getLogger(__name__)

_ACCEPTED = Outcome.ACCEPTED.value
_HARD = Outcome.REJECTED_HARD.value
_SOFT = Outcome.REJECTED_SOFT.value
_ON_CHAIN_SOFT = {Reason.STALE_VERSION.value}
TRANSIENT = {"http", "timeout", "unreachable", "rejected", None}
"""`ChainError.reason`s that say nothing about the items (the RPC failed, or refused our transaction itself):
the round stops and is tried again later."""
PERMANENT = {
    # invalidateHard / invalidateSoft: the key's state on chain will not change back
    "InvalidationWindowClosed", "WorkNotAccepted", "WorkOfOtherNode", "WorkCleared", "ZeroEvidenceHash",
    "ZeroAddress", "UnknownWorkKey", "DuplicateWorkKey",
    # recordWork of one item: the node left or was ejected after we accepted, or the item is malformed
    "NodeNotActive", "NodeIsEjected", "ZeroUnits", "BadParameters", "bad_argument",
}
"""Reverts of a one-item transaction that no retry can fix: the row becomes `unreportable`."""


class _RpcDown(Exception):
    """Internal: a transient RPC failure stops the round."""


class Reporter:
    def __init__(self, ledger: Ledger, pool: PoolClient | None, *, batch: int, hold_hard_s: float,
                 retry_backoff_s: float = 1.0, max_backoff_s: float = 300.0) -> None:
        self.ledger = ledger
        self.pool = pool
        self.batch = batch
        self.hold_hard_s = hold_hard_s
        self.retry_backoff_s = retry_backoff_s
        self.max_backoff_s = max_backoff_s
        self.reported = 0
        self.failures = 0
        self.deferred = 0
        """Rows whose transaction reverted for a reason that may pass (each deferral once)."""
        self.unreportable: Counter[str] = Counter()
        """Rows given up for good, by revert reason."""
        self.paused_until = 0.0
        """Unix time before which no round runs (the RPC failed; see `retry_backoff_s`)."""
        self._rpc_failures = 0
        self._lock = threading.Lock()

    def _backoff(self, failures: int) -> float:
        return float(min(self.max_backoff_s, self.retry_backoff_s * 2 ** min(failures, 30)))

    def _done_on_chain(self, row: OutboxRow, *done: WorkStatus) -> bool:
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
            if t < self.paused_until:
                return 0
            done = 0
            try:
                self._reconcile()
                accepted = self.ledger.outbox(_ACCEPTED, 10 * self.batch, now=t)
                for i in range(0, len(accepted), self.batch):
                    done += self._record(accepted[i : i + self.batch], t)
                hard = self.ledger.outbox(_HARD, self.batch, now=t, decided_before=t - self.hold_hard_s)
                if hard:
                    done += self._invalidate_many(hard, t, hard=True)
                off_chain: list[str] = []
                on_chain: list[OutboxRow] = []
                for row in self.ledger.outbox(_SOFT, 10 * self.batch, now=t):
                    if row.reason in _ON_CHAIN_SOFT and self.pool is not None:
                        on_chain.append(row)
                    else:
                        off_chain.append(row.work_key)
                for i in range(0, len(on_chain), self.batch):
                    done += self._invalidate_many(on_chain[i : i + self.batch], t, hard=False)
                self.ledger.mark_reported(off_chain, None, outcome=_SOFT)
                done += len(off_chain)
                self._rpc_failures = 0
            except _RpcDown as exc:
                self._rpc_failures += 1
                wait = self._backoff(self._rpc_failures - 1)
                self.paused_until = t + wait
                log.warning("chain RPC failing (%s); reporting again in %.0f s", exc, wait)
            self.reported += done
            return done

    def _reconcile(self) -> None:
        """Send again our transactions whose block left the chain (a reorg): rows marked reported on their
        receipt would otherwise never land (`Transactor.reconcile`; each send does it too, this covers a
        round with nothing to send)."""
        if self.pool is None:
            return
        try:
            self.pool.tx.reconcile()
        except ChainError as exc:
            if exc.reason in TRANSIENT:
                raise _RpcDown(str(exc)) from exc
            log.warning("checking our landed transactions failed: %s", exc)

    def _set_aside(self, row: OutboxRow, exc: ChainError, t: float) -> None:
        """A one-row transaction reverted: give the row up for good, or let it wait while the others go on."""
        reason = str(exc.reason)
        if reason in PERMANENT:
            if self.ledger.mark_unreportable(row.work_key, f"{reason}: {exc}", outcome=row.outcome, now=t):
                self.unreportable[reason] += 1
                log.error("%s verdict on %s of %s can never land on chain (%s); kept in the ledger as unreportable",
                          row.outcome, row.work_key, row.node, reason)
            return
        wait = self._backoff(row.report_attempts)
        self.ledger.defer_report(row.work_key, f"{reason}: {exc}", after=t + wait, outcome=row.outcome)
        self.deferred += 1
        log.warning("%s verdict on %s reverted (%s); trying it again in %.0f s, the others meanwhile", row.outcome,
                    row.work_key, reason, wait)

    def _record(self, rows: list[OutboxRow], t: float) -> int:
        if self.pool is None:
            self.ledger.mark_reported([r.work_key for r in rows], None, outcome=_ACCEPTED)
            return len(rows)
        items: list[tuple[str, bytes | str, int]] = [(r.node, r.work_key, r.units) for r in rows]
        try:
            receipt = self.pool.record_work_batch(items)
        except ChainError as exc:
            self.failures += 1
            log.warning("recordWorkBatch of %d keys failed: %s", len(rows), exc)
            if exc.reason in TRANSIENT:
                raise _RpcDown(str(exc)) from exc
            landed = [r for r in rows if self._done_on_chain(r, WorkStatus.ACCEPTED, WorkStatus.CLAIMED)]
            self.ledger.mark_reported([r.work_key for r in landed], None, outcome=_ACCEPTED)
            rest = [r for r in rows if r not in landed]
            if len(rows) > 1:  # one bad item must not block the rest: each goes alone
                return len(landed) + sum(self._record([r], t) for r in rest)
            for r in rest:
                self._set_aside(r, exc, t)
            return len(landed)
        self.ledger.mark_reported([r.work_key for r in rows], receipt.tx_hash, outcome=_ACCEPTED)
        log.info("recorded %d accepted submissions on chain (tx %s)", len(rows), receipt.tx_hash)
        return len(rows)

    def _invalidate_many(self, rows: list[OutboxRow], t: float, *, hard: bool) -> int:
        """Invalidations of one kind in one `invalidateHardBatch` / `invalidateSoftBatch`; a batch that reverts
        goes row by row, so one bad row is set aside and the rest land."""
        if self.pool is None or len(rows) == 1:
            return sum(self._invalidate(r, t, hard=hard) for r in rows)
        what = "invalidateHardBatch" if hard else "invalidateSoftBatch"
        try:
            if hard:
                assert all(r.evidence_hash is not None for r in rows), "a hard verdict always has evidence"
                receipt = self.pool.invalidate_hard_batch([(r.node, r.work_key, Reason(str(r.reason)).code,
                                                            str(r.evidence_hash)) for r in rows])
            else:
                receipt = self.pool.invalidate_soft_batch([(r.node, r.work_key, Reason(str(r.reason)).code)
                                                           for r in rows])
        except ChainError as exc:
            self.failures += 1
            log.warning("%s of %d keys failed: %s", what, len(rows), exc)
            if exc.reason in TRANSIENT:
                raise _RpcDown(str(exc)) from exc
            return sum(self._invalidate(r, t, hard=hard) for r in rows)
        for outcome in sorted({r.outcome for r in rows}):
            self.ledger.mark_reported([r.work_key for r in rows if r.outcome == outcome], receipt.tx_hash,
                                      outcome=outcome)
        log.info("invalidated%s %d submissions on chain in one transaction (%s)", " and slashed" if hard else "",
                 len(rows), receipt.tx_hash)
        return len(rows)

    def _invalidate(self, row: OutboxRow, t: float, *, hard: bool) -> int:
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
            if exc.reason in TRANSIENT:
                self.failures += 1
                raise _RpcDown(str(exc)) from exc
            if self._done_on_chain(row, WorkStatus.HARD_INVALIDATED if hard else WorkStatus.SOFT_INVALIDATED):
                self.ledger.mark_reported([row.work_key], None, outcome=row.outcome)
                return 1
            self.failures += 1
            log.warning("invalidate%s %s failed: %s", "Hard" if hard else "Soft", row.work_key, exc)
            self._set_aside(row, exc, t)
            return 0
        self.ledger.mark_reported([row.work_key], receipt.tx_hash, outcome=row.outcome)
        log.info("invalidated%s %s of %s (%s) on chain, tx %s", " and slashed" if hard else "", row.work_key,
                 row.node, row.reason, receipt.tx_hash)
        return 1
