"""The HTTP side of a validator: one posted submission taken in or refused, with nothing that needs a model.

`Intake.receive(bytes)` runs in the HTTP handler, cheapest first: size, identity (the same bytes again return
the same answer), envelope (domain, age, signature, canonical body), admission (the sender's chain status,
rate and quota, room in the backlog: `Admission`, `open_envelope`'s admission hook, *before* its nonce is
consumed, so a refused node can resend the same envelope; there too a validator covering for a down peer reads
the node's counter frontier on chain, and a chain that cannot be read is our failure, answered 503 + Retry-After:
`ChainUnavailableError`), then who checks it (`validator.assignment`: this
validator, a version on chain), the cheap checks (run, version window, manifest, counter, tasks, schema and
limits) and counter order. A failure there is decided at once; a pass is a `received` ledger row for the
checker (`validator.checker`). Every 200 or 202 carries our signed `Receipt` naming the bytes it answers: the same
bytes sent again (a node's resend) get the same answer and a receipt, never a second row or a refusal.

Timing hook (for `bench/validator.py`): the `timer` attribute (a `protocol.timing.StageTimer`) gets exclusive
seconds per stage: `intake.lookup` (submission hash, ledger lookups), `intake.parse` (envelope bytes),
`intake.open` (body validation, canonical body, signature recovery, replay guard), `intake.gate` (admission),
`intake.assignment`, `intake.cheap_checks` (run, version, manifest, tasks, schema), `intake.insert` (ledger row),
`intake.receipt` (the signed receipt of a 200 or 202),
and `verdict.seal` for the verdicts decided here.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from environments import MultiTurnEnvironment
from protocol.envelope import Envelope, NonceGuard, open_envelope, seal
from protocol.episodes import AnySubmission, EpisodeSubmission
from protocol.errors import ChainError, OversizeError, PrimeError, ProtocolError, ReplayError, SignatureError
from protocol.nonce import random_nonce
from protocol.rollout import Outcome, Reason, Receipt, Submission, submission_hash
from protocol.timing import StageTimer, stage
from validator.assignment import Assignment
from validator.chainview import CATCHUP_S, ChainView
from validator.episodes import episode_schema_problem
from validator.judge import PROOF_BYTES
from validator.ledger import Decision, Ledger, Row
from validator.ratelimit import Bucket, KeyedBuckets, take
from validator.verdicts import Verdicts, stored_submission

if TYPE_CHECKING:
    from toploc.thresholds import ToplocThresholds
    from validator.config import ValidatorConfig
    from validator.poolview import PoolView
    from validator.stats import Stats

log = logging.getLogger(__name__)

class NodeInactiveError(ProtocolError):
    """The signer is not a registered, active, staked node of this pool."""

    code = "node_inactive"


class RetryLaterError(ProtocolError):
    """Refused for now; the sender may retry after `retry_after` seconds (the `Retry-After` header)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimitedError(RetryLaterError):
    """The signer sent more than its share; retry after `retry_after` seconds."""

    code = "rate_limited"


class NodeQuotaError(RateLimitedError):
    """The signer stored its share of bytes for this window, or has a hard verdict here (or at a peer validator, by
    its signed notes) not yet on chain."""

    code = "node_quota"


class ChainUnavailableError(RetryLaterError):
    """What this submission needs from the chain could not be read (the counter frontier of a node this validator
    covers for), or our view of the chain is older than the submission and a signer it does not show as active
    may have registered since (`ChainView.fresh`): our failure, answered 503 + Retry-After before the nonce is spent, never a verdict or a refusal
    counted against the node ("a failure on the validator's own side is never a hard verdict")."""

    code = "chain_unavailable"


class TooManyHolesError(RateLimitedError):
    """The signer skipped more assignments (here, and at the peers whose notes we hold) than `flood.max_holes` at the last `flood.holes_window` versions:
    refused until enough of them leave the window (docs/protocol/assignment.md, "Skipping")."""

    code = "too_many_holes"


class OverloadedError(RetryLaterError):
    """This validator takes no more work now (backlog full or global rate reached); retry after `retry_after`."""

    code = "overloaded"


@dataclass
class Answer:
    """What the HTTP layer returns for one POST."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


class Admission:
    """Whether an authenticated sender may spend a nonce here, cheapest first: active on chain, within its rate,
    within the global rate, within its bytes for the window, no hard verdict of it pending here or at a peer (`pool`),
    within its skipped assignments in the pool (`flood.max_holes`), room in the backlog. `admit` raises to refuse (the nonce stays unconsumed); `admitted` counts the bytes of a request
    that got past the replay guard."""

    def __init__(self, chain: ChainView, ledger: Ledger, cfg: ValidatorConfig) -> None:
        self.chain, self.ledger = chain, ledger
        self.rate, self.burst, self.flood = cfg.rate_per_node, cfg.rate_burst, cfg.flood
        self.retry_hold_s = cfg.systemic.window_s
        self.read_back_s = 2 * cfg.chain.poll_s + 1.0  # a landed slash is in the chain view by then
        self._buckets = KeyedBuckets(self.rate, self.burst, max_keys=1 << 20)  # staked nodes: bounded by the stake
        self._global = Bucket(float(cfg.flood.burst), time.monotonic())
        self._bytes: dict[str, tuple[int, int]] = {}
        """node -> (window number, bytes admitted in it); only the current window's nodes are kept."""
        self._lock = threading.Lock()
        self.pool: PoolView | None = None
        """The peers' notes (`validator.poolview`), set by the service when it has peers: a hard verdict pending at
        any validator of the pool holds the node, and its holes count across the pool."""

    def _window(self) -> int:
        return int(time.time() // self.flood.window_s)

    def admit(self, signer: str, size: int, asked_at: float | None = None) -> None:
        """Raise to refuse; `asked_at` (time.monotonic()) is when the submission arrived (now by default)."""
        active = self.chain.node_active_fresh(signer, CATCHUP_S, asked_at)
        if active is None:  # our view is older than the submission: not known yet, never a refusal
            raise ChainUnavailableError(f"cannot tell yet whether {signer} is an active, staked node of this pool "
                                        "(our view of the chain is older than this submission); send again",
                                        max(self.chain.retry_after_s(CATCHUP_S), 0.1))
        if not active:
            raise NodeInactiveError(f"{signer} is not an active, staked node of this pool")
        mono, f = time.monotonic(), self.flood
        window = self._window()
        with self._lock:
            wait = self._buckets.take(signer, mono)
            if wait:
                raise RateLimitedError(f"{signer} is over {self.rate}/s", wait)
            wait = take(self._global, f.rate, f.burst, mono)
            if wait:
                raise OverloadedError(f"this validator takes at most {f.rate} submissions/s", wait)
            at, used = self._bytes.get(signer, (window, 0))
            used = used if at == window else 0
            if used + size > f.node_bytes_per_window:
                raise NodeQuotaError(f"{signer} stored {used} bytes here in this {f.window_s:.0f} s window (limit "
                                     f"{f.node_bytes_per_window})", (window + 1) * f.window_s - time.time())
        stored = self.ledger.node_stored_bytes(signer)  # a total, not a rate: it survives our restarts
        if stored + size > f.node_stored_bytes:
            raise NodeQuotaError(f"{signer} has {stored} bytes stored here (limit {f.node_stored_bytes})", f.window_s)
        pool = self.pool
        if f.hold_slashable:
            if self.ledger.hard_pending(signer, reported_since=time.time() - self.read_back_s):
                raise NodeQuotaError(f"{signer} has a hard verdict here that is not on chain yet", self.retry_hold_s)
            if pool is not None and (peer := pool.hard_pending_at(signer)) is not None:
                raise NodeQuotaError(f"{signer} has a hard verdict at validator {peer} that is not on chain yet",
                                     self.retry_hold_s)
        current = self.chain.current_version()
        if current is not None:
            since = max(0, current - f.holes_window + 1)
            holes = self.ledger.holes_since(signer, since) if pool is None else pool.holes_since(signer, since)
            if holes > f.max_holes:
                raise TooManyHolesError(f"{signer} skipped {holes} assignments in the pool at v{since}..v{current} "
                                        f"(limit {f.max_holes}): refused until they leave the window of {f.holes_window} "
                                        f"versions", f.window_s)
        backlog = self.ledger.backlog()
        if backlog >= f.max_backlog:
            raise OverloadedError(f"{backlog} submissions wait to be checked or reported (limit {f.max_backlog})",
                                  min(f.window_s, 10.0))

    def admitted(self, signer: str, size: int) -> None:
        window = self._window()
        with self._lock:
            if len(self._bytes) > 4 * len(self._buckets) + 64:  # forget nodes of past windows
                self._bytes = {k: v for k, v in self._bytes.items() if v[0] == window}
            at, used = self._bytes.get(signer, (window, 0))
            self._bytes[signer] = (window, (used if at == window else 0) + size)


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


def row_status(row: Row) -> dict[str, Any]:
    """A ledger row as the HTTP API shows it (`/v1/submissions/...` and every answer to a POST)."""
    return {
        "work_key": row.work_key, "submission_hash": row.submission_hash, "node": row.node,
        "policy_version": row.policy_version, "counter": row.counter, "state": row.state,
        "outcome": row.outcome, "reason": row.reason, "detail": row.detail,
        "measurements": json.loads(row.measurements) if row.measurements else None,
        "evidence_hash": row.evidence_hash, "chain_tx": row.chain_tx, "report_error": row.report_error,
        "verdict": row.verdict.decode() if row.verdict else None,
    }


def schema_problem(sub: Submission, cfg: ValidatorConfig, proof_block: int) -> str | None:
    """The first way `sub` breaks the run's shape and limits (samples, lengths, proofs, numbers), or None."""
    run = cfg.run
    for t, task in enumerate(sub.tasks):
        if len(task.samples) != run.samples_per_task:
            return f"task {t} has {len(task.samples)} samples, the run asks {run.samples_per_task}"
        for i, s in enumerate(task.samples):
            where = f"task {t} sample {i}"
            if len(s.tokens) > run.max_new_tokens:
                return f"{where}: {len(s.tokens)} tokens > max_new_tokens {run.max_new_tokens}"
            if s.finish_reason == "length" and len(s.tokens) != run.max_new_tokens:
                return f"{where}: finish_reason length with {len(s.tokens)} of {run.max_new_tokens} tokens"
            if len(s.proofs) != -(-len(s.tokens) // proof_block) or any(len(p) != PROOF_BYTES for p in s.proofs):
                return f"{where}: {len(s.proofs)} proofs for {len(s.tokens)} tokens (one {PROOF_BYTES}-byte " \
                       f"proof per {proof_block})"
            if not all(math.isfinite(x) and x <= 0.0 for x in s.logprobs) or not math.isfinite(s.reward):
                return f"{where}: logprobs must be finite and <= 0, reward finite"
    return None


class Intake:
    """Takes posted submissions in (see the module docstring); HTTP-free, `validator.app` serves it."""

    def __init__(self, cfg: ValidatorConfig, *, domain: str, assignment: Assignment, verdicts: Verdicts,
                 ledger: Ledger, chain: ChainView, replay_guard: NonceGuard, thresholds: ToplocThresholds,
                 stats: Stats) -> None:
        self.cfg, self.domain, self.assignment, self.verdicts = cfg, domain, assignment, verdicts
        self.ledger, self.chain, self.replay_guard, self.thresholds = ledger, chain, replay_guard, thresholds
        self.stats = stats
        self.admission = Admission(chain, ledger, cfg)
        self.timer: StageTimer | None = None

    def receive(self, data: bytes) -> Answer:
        """Cheap checks of one posted envelope; see the module docstring."""
        arrived = time.monotonic()
        self.stats.count("submissions_received")
        if len(data) > self.cfg.max_submission_bytes:
            self.stats.count("refused_oversize")
            return Answer(413, {"error": "oversize", "detail": f"{len(data)} bytes, limit "
                                f"{self.cfg.max_submission_bytes}"})
        timer = self.timer
        with stage(timer, "intake.lookup"):
            sub_hash = submission_hash(data)
            known = self.ledger.by_hash(_hex(sub_hash))
        if known is not None:  # the same bytes again (a resend): the same answer, never a second row or a strike
            return self._taken(known, sub_hash)
        envelope: Envelope | None = None
        counter_base: list[int | None] = []

        def admit(signer: str) -> None:
            with stage(timer, "intake.gate"):
                self.admission.admit(signer, len(data), arrived)
            assert envelope is not None  # the body is a valid Submission by now (open_envelope's order)
            with stage(timer, "intake.assignment"):  # chain reads before the nonce is spent: a retry resends it
                counter_base.append(self._counter_base(signer, int(envelope.body["policy_version"])))

        try:
            with stage(timer, "intake.parse"):
                envelope = Envelope.from_bytes(data, max_bytes=self.cfg.max_submission_bytes)
            with stage(timer, "intake.open"):
                body = open_envelope(envelope, domain=self.domain, replay_guard=self.replay_guard, admit=admit,
                                     body_types=[Submission, EpisodeSubmission], max_age_s=self.cfg.max_age_s)
        except OversizeError as exc:
            return self._refuse(413, exc, None)
        except SignatureError as exc:
            return self._refuse(401, exc, None)
        except NodeInactiveError as exc:
            return self._refuse(403, exc, envelope.signer if envelope else None)
        except RetryLaterError as exc:
            ours = isinstance(exc, ChainUnavailableError)  # our failure: never counted against the node
            answer = self._refuse(429 if isinstance(exc, RateLimitedError) else 503, exc,
                                  envelope.signer if envelope and not ours else None)
            answer.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
            return answer
        except ReplayError as exc:
            return self._refuse(409, exc, envelope.signer if envelope else None)
        except ProtocolError as exc:  # malformed, expired, wrong domain, unknown version, body invalid
            return self._refuse(400, exc, None)
        assert isinstance(body, Submission | EpisodeSubmission)
        self.admission.admitted(envelope.signer, len(data))
        if body.node != envelope.signer:
            return self._refuse(400, ProtocolError(f"submission names node {body.node}, signed by {envelope.signer}"),
                                envelope.signer)
        key = _hex(self.assignment.work_key(body.node, body.policy_version, body.counter))
        with stage(timer, "intake.lookup"):
            existing = self.ledger.get(key)
        if existing is None:
            with stage(timer, "intake.assignment"):
                early = self._not_ours_yet(body)
            if early is not None:
                return early
            with stage(timer, "intake.cheap_checks"):
                decision = self._cheap_checks(body, data)
                try:
                    out_of_order = self.assignment.counter_problem(body, counter_base[0] if counter_base else None) \
                        if decision is None else None
                except ChainError as exc:  # read before the nonce was spent, so only a race lands here
                    answer = self._refuse(503, self._chain_unavailable(body.node, exc), None)
                    answer.headers["Retry-After"] = str(max(1, math.ceil(self._chain_retry_s())))
                    return answer
            if out_of_order is not None:
                answer = self._refuse(409, out_of_order, body.node)
                answer.body.update(outcome=Outcome.REJECTED_SOFT.value, expected_counter=out_of_order.expected)
                return answer
            with stage(timer, "intake.insert"):
                inserted = self.ledger.insert(work_key=key, submission_hash=_hex(sub_hash), node=body.node,
                                              policy_version=body.policy_version, counter=body.counter,
                                              envelope=data, decision=decision)
            if inserted:
                row = self.ledger.get(key)
                assert row is not None
                return self._taken(row, sub_hash)
            existing = self.ledger.get(key)  # a concurrent request took the work key first
            assert existing is not None
        if not existing.envelope:  # pruned: its window passed, so nothing of it can change any more
            return Answer(409, {"error": "duplicate_work", "detail": "this assignment was already submitted",
                                **row_status(existing)})
        if stored_submission(existing) == body:  # the same payload sealed again (a retry): the same answer
            return self._taken(existing, sub_hash)
        return self._equivocation(existing, body, data)

    def _taken(self, row: Row, sub_hash: bytes) -> Answer:
        """The answer for envelope bytes hashing to `sub_hash` that `row` holds: 202 while it waits to be checked,
        200 after, with our signed `Receipt` naming those bytes (a node counts work as delivered only with it)."""
        status = 202 if row.state == "received" else 200
        with stage(self.timer, "intake.receipt"):
            receipt = Receipt(run_id=self.cfg.run.run_id, work_key=bytes.fromhex(row.work_key[2:]), node=row.node,
                              policy_version=row.policy_version, counter=row.counter, submission_hash=sub_hash,
                              state="decided" if row.outcome else "received")
            # a random nonce: a receipt is a record (the node keys it by the envelope's hash), no counter to persist
            sealed = seal(self.verdicts.identity, receipt, domain=self.domain, nonce=random_nonce())
        return Answer(status, {**row_status(row), "receipt": sealed.to_bytes().decode()})

    def _chain_retry_s(self) -> float:
        return 2 * self.cfg.chain.poll_s + 1.0

    def _chain_unavailable(self, node: str, exc: ChainError) -> ChainUnavailableError:
        log.warning("cannot read the chain for %s's counter frontier (%s): answered with a retry", node, exc)
        return ChainUnavailableError(f"this validator cannot read the chain now ({exc}); resend later",
                                     self._chain_retry_s())

    def _counter_base(self, node: str, version: int) -> int | None:
        """`Assignment.counter_base`, a chain that cannot be read turned into a retry (`ChainUnavailableError`)."""
        try:
            return self.assignment.counter_base(node, version)
        except ChainError as exc:
            raise self._chain_unavailable(node, exc) from exc

    def _refuse(self, status: int, exc: PrimeError, sender: str | None) -> Answer:
        self.stats.count(f"refused_{exc.code}")
        # An authenticated member of the pool: counted against it in the ledger. Keys that never registered
        # cost nothing to make, so they are only counted in the metrics (a row each would fill the disk).
        if sender is not None and self.chain.known(sender):
            self.ledger.count_refusal(sender, exc.code)
        return Answer(status, {"error": exc.code, "detail": str(exc)})

    def _equivocation(self, existing: Row, body: AnySubmission, data: bytes) -> Answer:
        """A second, different payload signed for an assignment that already has a row."""
        row = self.verdicts.equivocation(existing, body, data)
        return Answer(409, {"error": "duplicate_work", "detail": "this assignment was already submitted",
                            **row_status(row)})

    def _not_ours_yet(self, sub: AnySubmission) -> Answer | None:
        """Work another validator must check, or of a version our chain view has not seen yet: refused
        without a ledger row (soft, counted), so the assignment stays free for the right place and time. Work
        of a version that left the async window is refused the same way (410): it can never be paid, so it
        costs the validator no row, no stored envelope and no transaction, only the node's refusal count."""
        mine = self.assignment.taker(sub.node, sub.policy_version)
        if mine != self.assignment.me:
            self.ledger.count_refusal(sub.node, Reason.NOT_ASSIGNED_HERE.value)
            self.stats.count(f"refused_{Reason.NOT_ASSIGNED_HERE.value}")
            return Answer(421, {"error": Reason.NOT_ASSIGNED_HERE.value, "detail": f"assigned to {mine}",
                                "outcome": Outcome.REJECTED_SOFT.value, "assigned_validator": mine})
        current = self.chain.current_version()
        if current is None or sub.policy_version > current:
            self.ledger.count_refusal(sub.node, Reason.FUTURE_VERSION.value)
            self.stats.count(f"refused_{Reason.FUTURE_VERSION.value}")
            return Answer(425, {"error": Reason.FUTURE_VERSION.value, "outcome": Outcome.REJECTED_SOFT.value,
                                "detail": f"v{sub.policy_version} is not on chain yet (newest: {current})"},
                          {"Retry-After": "2"})
        if sub.policy_version < current - self.cfg.run.async_level:  # never paid, so never worth a row or a tx
            self.ledger.count_refusal(sub.node, Reason.STALE_VERSION.value)
            self.stats.count(f"refused_{Reason.STALE_VERSION.value}")
            return Answer(410, {"error": Reason.STALE_VERSION.value, "outcome": Outcome.REJECTED_SOFT.value,
                                "detail": f"v{sub.policy_version} is older than {current} - "
                                          f"{self.cfg.run.async_level}: outside the async window for good"})
        return None

    def _cheap_checks(self, sub: AnySubmission, data: bytes) -> Decision | None:
        problem = self.cheap_problem(sub, version_window=True)
        return None if problem is None else self.verdicts.reject(sub, data, *problem)

    def cheap_problem(self, sub: AnySubmission, *, version_window: bool) -> tuple[Reason, str] | None:
        """The first cheap check `sub` fails (no side effects). `version_window=False` skips the async window
        (an appeal re-checks work that was inside it when it was submitted)."""
        run = self.cfg.run
        if sub.run_id != run.run_id:
            return Reason.WRONG_RUN, f"run {sub.run_id!r}, this is {run.run_id!r}"
        current = self.chain.current_version() or 0
        if version_window and sub.policy_version < current - run.async_level:
            return Reason.STALE_VERSION, f"v{sub.policy_version} is older than {current} - {run.async_level}"
        if self.chain.manifest_hash(sub.policy_version) != sub.manifest_hash:
            return Reason.WRONG_MANIFEST, f"manifest {_hex(sub.manifest_hash)} is not the one published for " \
                                          f"v{sub.policy_version}"
        if sub.counter >= run.max_batches_per_version:
            return Reason.COUNTER_OUT_OF_RANGE, f"counter {sub.counter} >= {run.max_batches_per_version}"
        if (sub.env, sub.env_version) != (run.env, run.env_version):
            return Reason.WRONG_TASK, f"environment {sub.env}@{sub.env_version}, run uses {run.env}@{run.env_version}"
        assigned = [t.task_id for t in self.assignment.tasks(sub.node, sub.policy_version, sub.counter)]
        claimed = [t.task_id for t in sub.tasks]
        if claimed != assigned:
            return Reason.WRONG_TASK, f"tasks {claimed} are not the assigned {assigned}"
        if isinstance(sub, EpisodeSubmission) != isinstance(self.assignment.env, MultiTurnEnvironment):
            return Reason.SCHEMA, (f"submission version {type(sub).version} for {run.env}@{run.env_version} (a "
                                   "multi-turn environment takes version 2, a single-turn one version 1)")
        if isinstance(sub, EpisodeSubmission):
            problem = episode_schema_problem(sub, run, self.thresholds.decode_batching_size)
        else:
            problem = schema_problem(sub, self.cfg, self.thresholds.decode_batching_size)
        if problem is not None:
            return Reason.SCHEMA, problem
        return None
