"""Equivocation across validators: an assignment a peer recorded on chain that this validator holds too.

A node signs one payload per assignment (work key); a second, different one is `equivocation`, a hard verdict
whose evidence is both signed envelopes. One validator's intake sees both (`Intake._equivocation`). A node can
split them: payload P1 to its assigned validator A, which accepts it and has not reported yet, then, once A looks
down to its peer B, payload P2 to B, which covers for A. Each validator alone holds one honest-looking payload,
and whichever reports second finds the key already recorded (`recordWorkBatch` skips it without a word).

`CrossCheck.step` (the `crosscheck` service loop, every `pool_notes.crosscheck_s`) closes that. It reads the
pool's new `WorkRecorded` events; for a key another validator recorded for which our ledger holds a row with its
envelope (and no hard verdict yet), it asks that validator, one of the identified `peers`, for its row
(`GET /v1/submissions/{work_key}`) and, when the submission hash there differs from ours, for the envelope
(`GET /v1/envelopes/{hash}`). The envelope counts only when its bytes hash to that name and it opens in our
run's domain, signed by the node, for the very same assignment. Then:

- a different payload is an equivocation verdict on our row (`Verdicts.equivocation`, both envelopes in its
  evidence), which the reporter sends as the hard invalidation of the key the peer recorded (any validator may
  invalidate recorded work inside the pool's invalidation window): the node is slashed and the recorded work
  unpaid, so splitting gains nothing;
- the same payload sealed again (a retry that failed over to another validator) is nothing.

A peer that does not answer (or is not identified yet) is asked again with a doubling back-off (`RETRY_S` up to
`MAX_RETRY_S`) until the chain's invalidation window has passed since we read the event (the verdict could no
longer land), then given up, logged and counted. What a peer serves proves nothing unless the node signed it: a
lying peer can make us fetch, never slash. Restarted, the validator reads the events from the deployment block
again; keys it judged are hard by then, and a retried payload costs one fetch again.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from contracts.pool import PoolClient
from protocol.deadline import bounded_request, deadline_client
from protocol.errors import ChainError, PrimeError
from protocol.identity import checksum
from protocol.rollout import Outcome, submission_hash
from validator.ledger import Ledger, Row
from validator.stats import Stats
from validator.verdicts import Verdicts, carried_submission, stored_submission

log = logging.getLogger(__name__)

RETRY_S = 2.0
"""The first wait before a peer that did not answer is asked again (doubled each time)."""
MAX_RETRY_S = 300.0
"""The longest wait between two asks."""
ROW_MAX_BYTES = 1 << 20
"""A peer's `/v1/submissions/{work_key}` answer is read up to this (its measurements are small)."""


_HASH = re.compile(r"0x[0-9a-f]{64}")


class _Retry(Exception):
    """Internal: the peer could not be asked now (unreachable, not identified, an answer that is not a row)."""


@dataclass
class _Pending:
    work_key: str
    recorder: str
    seen_at: float
    attempts: int = 0
    next_at: float = 0.0


class CrossCheck:
    """Keys recorded by peers, checked against the payload our ledger holds (see the module docstring)."""

    def __init__(self, pool: PoolClient, start_block: int, *, ledger: Ledger, verdicts: Verdicts, me: str,
                 peers: Callable[[], dict[str, str]], domain: str, max_submission_bytes: int, timeout_s: float,
                 invalidation_window: Callable[[], int | None], stats: Stats) -> None:
        self.ledger, self.verdicts, self.me, self.domain = ledger, verdicts, checksum(me), domain
        self.max_submission_bytes, self.timeout_s, self.stats = max_submission_bytes, timeout_s, stats
        self._peers, self._window = peers, invalidation_window
        self._events = pool.cursor(start_block, {"WorkRecorded"})
        self._pending: dict[str, _Pending] = {}
        self._judged: set[str] = set()
        """Keys checked in this process (a block read again gives its events again)."""
        self._http = deadline_client(timeout_s)

    def step(self, now: float | None = None) -> int:
        """Read the new `WorkRecorded` events and ask the peers that are due; returns the equivocations found."""
        t = time.time() if now is None else now
        try:
            events = self._events.read()
        except ChainError as exc:  # the keys already pending are still asked about
            log.warning("cannot read the pool's WorkRecorded events: %s", exc)
            events = []
        for ev in events:
            recorder = checksum(str(ev.args["validator"]))
            key = "0x" + bytes(ev.args["workKey"]).hex()
            if recorder == self.me or key in self._judged or key in self._pending:
                continue
            row = self.ledger.get(key)
            if row is not None and row.envelope and row.outcome != Outcome.REJECTED_HARD.value:
                self._pending[key] = _Pending(key, recorder, t)
        found = 0
        for p in list(self._pending.values()):
            if p.next_at > t:
                continue
            try:
                verdict = self._check(p)
            except _Retry as exc:
                self._again(p, t, str(exc))
                continue
            del self._pending[p.work_key]
            self._judged.add(p.work_key)
            self.stats.count(f"crosscheck_{verdict}")
            found += verdict == "equivocation"
        return found

    def pending(self) -> int:
        """Keys a peer recorded that wait for its answer."""
        return len(self._pending)

    def judged(self, work_key: str) -> bool:
        """Whether this process has compared `work_key`'s payload with the peer that recorded it (a verdict counted:
        `same` or `equivocation`)."""
        return work_key in self._judged

    def _again(self, p: _Pending, t: float, why: str) -> None:
        window = self._window()
        if window is not None and t - p.seen_at > window:
            del self._pending[p.work_key]
            self.stats.count("crosscheck_given_up")
            log.error("gave up comparing %s with %s's payload after %d tries (%s): the invalidation window has "
                      "passed", p.work_key, p.recorder, p.attempts, why)
            return
        wait = min(MAX_RETRY_S, RETRY_S * 2 ** min(p.attempts, 30))
        p.attempts += 1
        p.next_at = t + wait
        self.stats.count("crosscheck_unreachable")
        log.warning("cannot compare %s with %s's payload yet (%s); asking again in %.0f s", p.work_key, p.recorder,
                    why, wait)

    def _get(self, url: str, max_bytes: int) -> bytes | None:
        """The body of a 200, None for a 404; `_Retry` for anything else."""
        try:
            r = bounded_request(self._http, "GET", url, self.timeout_s, max_bytes=max_bytes)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "ask again later"
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise _Retry(f"GET {url} answered {r.status_code}")
        return r.content

    def _check(self, p: _Pending) -> str:
        """`equivocation`, `same` (the payload we hold), `gone` (nothing here or there to compare any more) or
        `refused` (the peer served what the node did not sign for this assignment); `_Retry` to ask again."""
        row = self.ledger.get(p.work_key)
        if row is None or not row.envelope or row.outcome == Outcome.REJECTED_HARD.value:
            return "gone"  # pruned, or judged hard meanwhile (by intake or the checker)
        url = self._peers().get(p.recorder)
        if url is None:
            raise _Retry(f"{p.recorder} is not an identified peer (yet)")
        base = url.rstrip("/")
        raw = self._get(f"{base}/v1/submissions/{p.work_key}", ROW_MAX_BYTES)
        if raw is None:
            log.warning("%s recorded %s on chain but does not serve its row (pruned?): nothing to compare",
                        p.recorder, p.work_key)
            return "gone"
        try:
            theirs = str(json.loads(raw)["submission_hash"]).lower()
        except (ValueError, KeyError, TypeError) as exc:
            raise _Retry(f"its row is not a submission status: {exc}") from exc
        if not _HASH.fullmatch(theirs):
            raise _Retry(f"its row names no submission hash: {theirs[:80]!r}")
        if theirs == row.submission_hash.lower():
            return "same"
        data = self._get(f"{base}/v1/envelopes/{theirs}", self.max_submission_bytes)
        if data is None:
            return "gone"
        if "0x" + submission_hash(data).hex() != theirs:
            log.warning("%s served bytes for %s that do not hash to %s", p.recorder, p.work_key, theirs)
            return "refused"
        return self._compare(row, data, p.recorder)

    def _compare(self, row: Row, data: bytes, recorder: str) -> str:
        try:
            second = carried_submission(data, domain=self.domain, node=row.node, max_bytes=self.max_submission_bytes)
        except PrimeError as exc:
            log.warning("%s served an envelope for %s that %s did not sign in this run: %s", recorder, row.work_key,
                        row.node, exc)
            return "refused"
        key = self.verdicts.assignment.work_key(second.node, second.policy_version, second.counter)
        if "0x" + key.hex() != row.work_key:
            log.warning("%s served an envelope of another assignment for %s", recorder, row.work_key)
            return "refused"
        if second == stored_submission(row):
            return "same"  # sealed again with another nonce: a retry that failed over, not a second payload
        self.verdicts.equivocation(row, second, data)
        log.warning("equivocation: %s signed a different payload for %s (#%d at v%d), which %s recorded; ours is "
                    "now a hard verdict with both envelopes as evidence", row.node, row.work_key, row.counter,
                    row.policy_version, recorder)
        return "equivocation"

    def close(self) -> None:
        self._http.close()
