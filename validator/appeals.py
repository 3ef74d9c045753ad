"""Appeals: re-checking another validator's hard verdict when the slashed node asks (`POST /v1/appeals`).

The node sends a signed `protocol.appeal.Appeal` carrying the hard `Verdict` envelope it received and its
own submission envelope as it sent it (`Submission`, or `EpisodeSubmission` for multi-turn episodes). Checks, cheapest first, each with its own answer:

1. size (413), the appeal envelope (400 malformed/expired/wrong domain, 401 signature), its signer is the
   node key or the node's operator on chain (403 `not_appellant`), its nonce is new (409 `replay`);
2. the carried envelopes: the verdict is signed, of this run and domain, about this node and work key
   (400 `bad_verdict`), hard (409 `not_hard`) and not ours (409 `own_verdict`: a validator never judges
   its own verdict, unless it is the pool's only validator: then there is no second opinion to be had and
   it re-checks its own); the submission is signed by the node and hashes to the verdict's
   `submission_hash` (400 `bad_submission`);
3. the chain: the key is hard-invalidated for this node by the verdict's signer, and the node filed its
   appeal inside the window (409 `not_filed`, 410 `appeal_window_closed` when the window is over,
   409 `already_resolved`);
4. the re-check, with exactly the intake thresholds (`checks.*`; an appeal corrects a validator's
   mistakes, it is not a looser second chance): cheap checks (less the async window: the work was inside
   it when it was submitted), rewards recomputed, one prefill for TOPLOC, the seeded sampling replay,
   termination and logprobs. Episodes go through the checker's own turn-by-turn check
   (`validator.checker.Checker.episodes`: the environment replayed, the reward recomputed, one prefill
   per episode measured at model positions).

An equivocation verdict is re-checked from its evidence alone: the appeal carries the slasher's evidence
document (its SHA-256 is the verdict's `evidence_hash`, 400 `bad_evidence` otherwise), and the verdict is
upheld only if that document holds two envelopes the node's key signed, in this domain, for this same
assignment, with different payloads, one of them the judged submission (no model needed); evidence that
proves no such thing sends the judged submission through the full re-check, so an overturned
equivocation never restores work nobody checked.

Our failures are never the node's: when the re-check cannot run (weights of that version not here, our
chain view lacks the version, the grader or the model failing) the answer is 503 `cannot_check` and
nothing is resolved, so another validator can take it. A decision is signed (`AppealDecision`), stored with its
evidence in the ledger (one per work key: the first stands), then resolved on chain (`resolveAppeal`);
a failed transaction is retried by `resolve_pending`. An overturned verdict restores the work: it enters
this validator's trainer feed in the same transaction as the decision (a `FeedItem` with our replay's
logprobs and recomputed rewards, like accepted work; an `EpisodeFeedItem` for episodes), and leaves it again if the chain settles the
appeal as upheld (another validator resolved it first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from contracts.pool import EscrowStatus, PoolClient, WorkStatus
from protocol.appeal import Appeal, AppealDecision, AppealOutcome
from protocol.canonical import canonical_bytes
from protocol.envelope import Envelope, NonceGuard, open_envelope, seal
from protocol.episodes import AnySubmission, EpisodeFeedItem, EpisodeSubmission
from protocol.errors import (
    ChainError,
    ModelError,
    PrimeError,
    ProtocolError,
    ReplayError,
    SignatureError,
    UngradableError,
)
from protocol.identity import Identity, checksum
from protocol.nonce import NonceCounter
from protocol.replay import RereadRecords
from protocol.rollout import FeedItem, Outcome, Reason, Submission, Verdict, submission_hash
from validator.chainview import ChainView
from validator.episodes import episode_feed_item
from validator.intake import Answer
from validator.judge import Measurements, paid_tokens, reward_mismatch, tolerances_of, units
from validator.ledger import AppealRow, Ledger
from validator.near_tie_rule import NearTieRuleError, beyond_honest
from validator.verdicts import SOFTWARE, STORED_AGE_S, carried_submission
from validator.weights import WeightStore, WeightsUnavailable

if TYPE_CHECKING:
    from validator.config import ValidatorConfig
    from validator.core import Core

log = logging.getLogger(__name__)

class NotAppellantError(ProtocolError):
    """The appeal is signed by neither the node key nor the node's operator."""

    code = "not_appellant"


class _AppellantGate:
    """`open_envelope`'s admission hook for an appeal: its (authenticated) signer must be the node or its
    operator, checked before the appeal's nonce is spent."""

    def __init__(self, pool: PoolClient | None, node: str) -> None:
        self.pool, self.node = pool, node
        self.signer = ""

    def admit(self, signer: str) -> None:
        if signer != self.node:
            operator = None
            if self.pool is not None:
                try:
                    operator = self.pool.get_node(self.node).operator
                except ChainError as exc:
                    raise _CannotCheck(f"cannot read the node's operator on chain: {exc}") from exc
            if signer != operator:
                raise NotAppellantError(f"{signer} is neither node {self.node} nor its operator")
        self.signer = signer


class _CannotCheck(PrimeError):
    """The re-check cannot run here; never resolved against the node."""

    code = "cannot_check"


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


def _address(value: object) -> str:
    """The checksum form of a claimed address, or "" (the body check then refuses it)."""
    try:
        return checksum(value) if isinstance(value, str) else ""
    except PrimeError:
        return ""


class AppealDesk:
    """Answers appeals and resolves them on chain (see the module docstring)."""

    def __init__(self, cfg: ValidatorConfig, identity: Identity, ledger: Ledger, chain: ChainView,
                 pool: PoolClient | None, core: Core, weights: WeightStore, *, domain: str,
                 replay_guard: NonceGuard, nonces: NonceCounter) -> None:
        self.cfg, self.identity, self.ledger, self.chain, self.pool = cfg, identity, ledger, chain, pool
        self.core, self.weights, self.domain = core, weights, domain
        self.stats = core.stats
        self.replay_guard, self.nonces = replay_guard, nonces
        self.thresholds = core.checker.thresholds  # the intake thresholds, never looser ones
        self._lock = threading.Lock()  # one re-check at a time (appeals are rare; the checker has the model)
        self._resolve_lock = threading.Lock()

    # -- HTTP ---------------------------------------------------------------------------------------

    def handle(self, data: bytes) -> Answer:
        """One posted appeal envelope; see the module docstring for every answer."""
        self.stats.count("appeals_received")
        try:
            return self._handle(data)
        except _CannotCheck as exc:
            self.stats.count("appeals_cannot_check")
            log.warning("appeal: cannot check here: %s", exc)
            return Answer(503, {"error": "cannot_check", "detail": str(exc)}, {"Retry-After": "30"})

    def _refuse(self, status: int, error: str, detail: str) -> Answer:
        self.stats.count(f"appeals_refused_{error}")
        return Answer(status, {"error": error, "detail": detail})

    def _handle(self, data: bytes) -> Answer:
        if not self.cfg.appeals.enabled:
            return self._refuse(503, "appeals_disabled", "this validator does not take appeals")
        limit = self.cfg.appeals.max_appeal_bytes
        if len(data) > limit:
            return self._refuse(413, "oversize", f"{len(data)} bytes, limit {limit}")
        try:
            envelope = Envelope.from_bytes(data, max_bytes=limit)
            gate = _AppellantGate(self.pool, _address(envelope.body.get("node")))
            body = open_envelope(envelope, domain=self.domain, replay_guard=self.replay_guard, admit=gate.admit,
                                 body_types=[Appeal], max_age_s=self.cfg.max_age_s)
        except SignatureError as exc:
            return self._refuse(401, exc.code, str(exc))
        except NotAppellantError as exc:
            return self._refuse(403, exc.code, str(exc))
        except ReplayError as exc:
            return self._refuse(409, exc.code, str(exc))
        except PrimeError as exc:  # malformed, expired, wrong domain or kind, a bad address
            if isinstance(exc, _CannotCheck):
                raise
            return self._refuse(400, getattr(exc, "code", "malformed"), str(exc))
        assert isinstance(body, Appeal)
        if body.run_id != self.cfg.run.run_id:
            return self._refuse(400, "wrong_run", f"run {body.run_id!r}, this is {self.cfg.run.run_id!r}")
        key = _hex(body.work_key)

        # the carried verdict and submission
        try:
            v_env = Envelope.from_bytes(body.verdict.encode(), max_bytes=self.cfg.max_submission_bytes)
            verdict = open_envelope(v_env, domain=self.domain, replay_guard=RereadRecords(), body_types=[Verdict],
                                    max_age_s=STORED_AGE_S)
        except PrimeError as exc:
            return self._refuse(400, "bad_verdict", f"the carried verdict: {exc}")
        assert isinstance(verdict, Verdict)
        slasher = v_env.signer
        if (verdict.node, verdict.work_key, verdict.run_id) != (body.node, body.work_key, body.run_id):
            return self._refuse(400, "bad_verdict", "the verdict is about another node, work key or run")
        if verdict.outcome is not Outcome.REJECTED_HARD:
            return self._refuse(409, "not_hard", f"the verdict is {verdict.outcome.value}: nothing was slashed")
        if slasher == self.identity.address and not self._only_validator():
            return self._refuse(409, "own_verdict", "this validator gave that verdict; appeal to another one")
        try:
            s_bytes = body.submission.encode()
            sub = carried_submission(s_bytes, domain=self.domain, node=body.node,
                                     max_bytes=self.cfg.max_submission_bytes)
        except PrimeError as exc:
            return self._refuse(400, "bad_submission", f"the carried submission: {exc}")
        if submission_hash(s_bytes) != verdict.submission_hash:
            return self._refuse(400, "bad_submission", "the submission's hash is not the one the verdict judged")
        if self.core.assignment.work_key(sub.node, sub.policy_version, sub.counter) != body.work_key:
            return self._refuse(400, "bad_submission", "the submission is for another assignment")

        done = self.ledger.appeal(key)
        if done is not None:  # decided before (a resent appeal): the first decision stands
            return Answer(200, self.status(done))

        refusal = self._chain_state(key, body.node, slasher)
        if refusal is not None:
            return refusal
        with self._lock:
            done = self.ledger.appeal(key)
            if done is not None:
                return Answer(200, self.status(done))
            failure = None
            if verdict.reason is Reason.EQUIVOCATION:
                try:
                    failure = self._equivocation_proven(body.evidence, verdict, sub)
                except ProtocolError as exc:
                    return self._refuse(400, "bad_evidence", str(exc))
            steering: tuple[Reason, str] | None = None
            if verdict.reason is Reason.NEAR_TIE_STEERING:
                try:
                    steering = self._steering_proven(body.evidence, verdict, sub)
                except ProtocolError as exc:
                    return self._refuse(400, "bad_evidence", str(exc))
            if failure is not None:  # proven from the evidence alone: no model needed
                row = self._decide(data, gate.signer, slasher, verdict, sub, failure,
                                   Measurements(extra={"equivocation": True}))
            else:  # not an equivocation, or one its evidence does not prove: the judged work is re-checked in full
                row = self._recheck(data, gate.signer, slasher, verdict, sub, steering)
        self.resolve(row)
        row = self.ledger.appeal(key) or row
        return Answer(200, self.status(row))

    def _only_validator(self) -> bool:
        """Whether this validator is the pool's only one (then it re-checks appeals of its own verdicts)."""
        if self.pool is None:
            return False
        try:
            return self.pool.validator_count() == 1 and self.pool.has_role("validator", self.identity.address)
        except ChainError as exc:
            raise _CannotCheck(f"cannot read the validator set on chain: {exc}") from exc

    def _chain_state(self, key: str, node: str, slasher: str) -> Answer | None:
        """None when the chain holds an appeal to decide; else the refusal."""
        if self.pool is None:
            raise _CannotCheck("this validator does not report to the chain (reporter disabled): it cannot resolve")
        try:
            work = self.pool.get_work(key)
            escrow = self.pool.get_escrow(key)
            now = self.pool.pool_time()
        except ChainError as exc:
            raise _CannotCheck(f"cannot read the chain: {exc}") from exc
        if work.status is not WorkStatus.HARD_INVALIDATED or work.node != node or escrow.status is EscrowStatus.NONE:
            return self._refuse(409, "not_slashed", f"the pool holds {work.status.name} for this key, not a hard "
                                "invalidation of this node")
        if escrow.slasher != slasher:
            return self._refuse(400, "bad_verdict", f"the key was slashed on chain by {escrow.slasher}, the verdict "
                                f"is signed by {slasher}")
        if escrow.status is EscrowStatus.HELD:
            if now >= escrow.appeal_deadline:
                return self._refuse(410, "appeal_window_closed", f"the appeal window closed at pool time "
                                    f"{escrow.appeal_deadline} (now {now})")
            return self._refuse(409, "not_filed", "file the appeal on chain first (ComputePool.appeal(workKey), "
                                f"before pool time {escrow.appeal_deadline}; `prime-node appeal` does both)")
        if escrow.status is EscrowStatus.RELEASED:
            return self._refuse(410, "appeal_window_closed", "the appeal window closed and the escrow went to the "
                                "treasury")
        if escrow.status is not EscrowStatus.APPEALED:
            return self._refuse(409, "already_resolved", f"the appeal was resolved on chain: {escrow.status.name}")
        return None

    # -- the re-check -------------------------------------------------------------------------------

    def _equivocation_proven(self, evidence: str | None, verdict: Verdict,
                             sub: AnySubmission) -> tuple[Reason, str] | None:
        """(EQUIVOCATION, detail) when the slasher's own evidence proves that the node's key signed two different
        payloads for this assignment; None when it does not (the verdict is overturned). `ProtocolError` when
        the appeal carries no evidence, or not the document the verdict committed to."""
        raw = _committed_evidence(evidence, verdict, "an equivocation")
        try:
            doc = json.loads(raw)
            texts = [doc["first"], doc["submission"]]
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("envelopes must be strings")
        except (ValueError, KeyError, TypeError):
            return None  # the slasher's own evidence does not hold two envelopes: nothing proven
        bodies: list[AnySubmission] = []
        hashes: list[bytes] = []
        for text in texts:
            try:
                opened = carried_submission(text.encode(), domain=self.domain, node=sub.node,
                                            max_bytes=self.cfg.max_submission_bytes)
            except PrimeError:
                return None  # not the node's signature (or not this run's): nothing proven against the node
            bodies.append(opened)
            hashes.append(submission_hash(text.encode()))
        first, second = bodies
        same_assignment = all((b.run_id, b.node, b.policy_version, b.counter) ==
                              (sub.run_id, sub.node, sub.policy_version, sub.counter) for b in bodies)
        if not same_assignment or first == second or verdict.submission_hash not in hashes:
            return None
        return Reason.EQUIVOCATION, (f"the evidence holds two different payloads signed by {sub.node} for "
                                     f"assignment #{sub.counter} at v{sub.policy_version}")

    def _steering_proven(self, evidence: str | None, verdict: Verdict, sub: AnySubmission
                         ) -> tuple[Reason, str] | None:
        """(NEAR_TIE_STEERING, detail) when the slasher's evidence shows an account of accepted work beyond the
        honest near-tie tail at *this* validator's honest rate for `sub`'s declared precision (an appeal corrects a
        miscalibrated rate); None when it does not (the verdict is overturned if the work itself passes).
        `ProtocolError` when the appeal carries no evidence, or not the document the verdict committed to."""
        raw = _committed_evidence(evidence, verdict, "a near_tie_steering")
        try:
            account = json.loads(raw)["near_tie_account"]
            tokens, near = account["tokens"], account["near_ties"]
            p = tolerances_of(self.cfg, sub).near_tie_honest_rate
            if not beyond_honest(tokens, near, p):
                return None
        except (ValueError, KeyError, TypeError, NearTieRuleError):
            return None  # the slasher's own evidence shows no account beyond the tail: nothing proven
        return Reason.NEAR_TIE_STEERING, (f"the slasher's account holds {near} near-tie disagreements in {tokens} "
                                          f"paid tokens, beyond the honest tail at rate {p:g} per token")

    def _recheck(self, data: bytes, appellant: str, slasher: str, verdict: Verdict, sub: AnySubmission,
                 steering: tuple[Reason, str] | None = None) -> AppealRow:
        core = self.core
        if self.chain.manifest_hash(sub.policy_version) is None:
            raise _CannotCheck(f"v{sub.policy_version} is not in this validator's chain view (yet)")
        measurements = Measurements()
        feed: FeedItem | EpisodeFeedItem | None = None
        failure = core.intake.cheap_problem(sub, version_window=False)
        if failure is None and isinstance(sub, EpisodeSubmission):
            try:
                loaded = self.weights.get(sub.policy_version)
            except WeightsUnavailable as exc:
                raise _CannotCheck(str(exc)) from exc
            try:
                got = core.checker.episodes(loaded, sub)
            except UngradableError as exc:  # the environment's own code failing is ours
                raise _CannotCheck(f"environment: {exc}") from exc
            except (ModelError, RuntimeError, MemoryError) as exc:
                raise _CannotCheck(f"model stage: {exc}") from exc
            failure = got.failure
            measurements = Measurements(rewards=got.rewards, samples=tuple(m for ms in got.turns for m in ms))
            if failure is None:  # restored episodes reach the trainer like accepted ones, with our replay's numbers
                feed = episode_feed_item(verdict.work_key, sub, got)
        elif failure is None:
            assert isinstance(sub, Submission)
            try:
                loaded = self.weights.get(sub.policy_version)
            except WeightsUnavailable as exc:
                raise _CannotCheck(str(exc)) from exc
            tasks = core.assignment.tasks(sub.node, sub.policy_version, sub.counter)
            try:
                rewards = core.grader.rewards(loaded, sub, tasks)
            except Exception as exc:  # noqa: BLE001 - our grader failing is ours, whatever it raised
                raise _CannotCheck(f"grader: {type(exc).__name__}: {exc}") from exc
            measurements = Measurements(rewards=rewards)
            bad = reward_mismatch(sub, rewards, self.cfg.checks.reward_tolerance)
            if bad is not None:
                failure = (Reason.REWARD_MISMATCH, bad)
            else:
                try:
                    (reports,) = core.checker.measure(loaded, [(sub, tasks)], self.thresholds)
                except (ModelError, RuntimeError, MemoryError) as exc:
                    raise _CannotCheck(f"model stage: {exc}") from exc
                judgement = core.checker.judge(sub, reports, self.thresholds)
                failure = judgement.failure or steering  # the work passes: a steering verdict stands on its account
                measurements = Measurements(rewards=rewards, samples=judgement.samples)
                if failure is None:  # restored work reaches the trainer like accepted work, with our replay's numbers
                    try:
                        feed = core.verdicts.feed_item(loaded, verdict.work_key, sub, tasks, rewards, reports)
                    except UngradableError as exc:  # our grader, on a sample cut at the replay's EOS
                        raise _CannotCheck(f"grader: {exc}") from exc
        return self._decide(data, appellant, slasher, verdict, sub, failure, measurements, feed)

    def _decide(self, data: bytes, appellant: str, slasher: str, verdict: Verdict, sub: AnySubmission,
                failure: tuple[Reason, str] | None, measurements: Measurements,
                feed: FeedItem | EpisodeFeedItem | None = None) -> AppealRow:
        """Sign, store and count the decision (`failure` None: overturned), with the restored work's feed item."""
        outcome = AppealOutcome.UPHELD if failure is not None else AppealOutcome.OVERTURNED
        reason, detail = failure if failure is not None else (Reason.ACCEPTED, f"passes the intake thresholds "
                                                              f"({sub.n_samples()} samples, {sub.n_tokens()} tokens)")
        key = _hex(verdict.work_key)
        evidence = canonical_bytes({
            "software": SOFTWARE, "kind": "appeal", "work_key": key, "appeal": data.decode(), "slasher": slasher,
            "original_reason": verdict.reason.value, "outcome": outcome.value, "reason": reason.value,
            "detail": detail, "measurements": measurements.to_json(),
            "thresholds": self.cfg.checks.model_dump(mode="json"),
            "run": self.cfg.run.model_dump(mode="json")})
        evidence_hash = _hex(hashlib.sha256(evidence).digest())
        decision = AppealDecision(
            run_id=self.cfg.run.run_id, work_key=verdict.work_key, node=sub.node, slasher=slasher,
            original_reason=verdict.reason.value, outcome=outcome, reason=reason.value,
            evidence_hash=bytes.fromhex(evidence_hash[2:]))
        signed = seal(self.identity, decision, domain=self.domain, nonce=self.nonces.next(self.domain)).to_bytes()
        row = AppealRow(
            work_key=key, node=sub.node, slasher=slasher, appellant=appellant, received_at=time.time(), appeal=data,
            original_reason=verdict.reason.value, outcome=outcome.value, reason=reason.value, detail=detail,
            measurements=json.dumps(measurements.to_json()),
            units=units(sub, self.cfg.reporter.units_per_token, paid_tokens(measurements.samples)),
            evidence_hash=evidence_hash, decision=signed,
            resolved_at=None, chain_tx=None)
        feed_bytes = None
        if feed is not None:
            feed_bytes = seal(self.identity, feed, domain=self.domain, nonce=self.nonces.next(self.domain)).to_bytes()
        self.ledger.record_appeal(row, evidence, feed_bytes)
        self.stats.count(f"appeals_{outcome.value}")
        log.info("appeal of %s (node %s, slashed by %s for %s): %s (%s: %s) evidence %s", key, sub.node, slasher,
                 verdict.reason.value, outcome.value, reason.value, detail, evidence_hash)
        return self.ledger.appeal(key) or row

    # -- the chain ----------------------------------------------------------------------------------

    def resolve(self, row: AppealRow) -> bool:
        """`resolveAppeal` for one decided appeal; True once the chain shows it resolved."""
        if self.pool is None or row.resolved_at is not None:
            return row.resolved_at is not None
        with self._resolve_lock:
            upheld = row.outcome == AppealOutcome.UPHELD.value
            try:
                receipt = self.pool.resolve_appeal(row.work_key, upheld, row.units, row.evidence_hash)
            except ChainError as exc:
                try:
                    status = self.pool.get_escrow(row.work_key).status
                except ChainError:
                    status = None
                if status in (EscrowStatus.UPHELD, EscrowStatus.OVERTURNED):  # landed, or another resolver did
                    self.ledger.mark_appeal_resolved(row.work_key, None)
                    if status is not (EscrowStatus.UPHELD if upheld else EscrowStatus.OVERTURNED):
                        log.warning("appeal of %s: resolved on chain as %s by someone else (we decided %s)",
                                    row.work_key, status.name, row.outcome)
                        if status is EscrowStatus.UPHELD and self.ledger.withdraw_feed(row.work_key):
                            log.warning("appeal of %s: its restored work leaves our trainer feed", row.work_key)
                    return True
                log.warning("resolveAppeal %s failed (will retry): %s", row.work_key, exc)
                return False
            self.ledger.mark_appeal_resolved(row.work_key, receipt.tx_hash)
            log.info("appeal of %s resolved on chain: %s (tx %s)", row.work_key, row.outcome, receipt.tx_hash)
            return True

    def resolve_pending(self) -> int:
        """Resolve decided appeals whose transaction failed before; returns how many were resolved."""
        return sum(self.resolve(row) for row in self.ledger.unresolved_appeals(32))

    # -- views ----------------------------------------------------------------------------------------

    @staticmethod
    def status(row: AppealRow) -> dict[str, Any]:
        return {
            "work_key": row.work_key, "node": row.node, "slasher": row.slasher, "appellant": row.appellant,
            "original_reason": row.original_reason, "outcome": row.outcome, "reason": row.reason,
            "detail": row.detail, "measurements": json.loads(row.measurements) if row.measurements else None,
            "units": row.units, "evidence_hash": row.evidence_hash, "resolved": row.resolved_at is not None,
            "chain_tx": row.chain_tx, "decision": row.decision.decode(),
        }


def _committed_evidence(evidence: str | None, verdict: Verdict, what: str) -> bytes:
    """The slasher's evidence document an appeal of `what` verdict carries, when it is the one `verdict` committed
    to (its hash); `ProtocolError` when the appeal carries none or another."""
    if evidence is None:
        raise ProtocolError(f"{what} verdict is re-checked from its evidence: carry the slasher's evidence document "
                            "(GET /v1/evidence/{evidence_hash} at the slasher)")
    raw = evidence.encode()
    if verdict.evidence_hash is None or hashlib.sha256(raw).digest() != verdict.evidence_hash:
        raise ProtocolError("the evidence is not the document whose hash the verdict carries")
    return raw
