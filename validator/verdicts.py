"""Verdicts as the network sees them: signed, with evidence for every hard one, and feed items for the trainer.

Every hard verdict carries evidence (the submission's hash, what was measured, the thresholds, this software's
version) whose SHA-256 goes on chain; the submission itself is stored once, in its ledger row, and served by
its hash (`GET /v1/envelopes/{submission_hash}`), so a flood of failures is not stored twice. Accepted work
becomes a signed `FeedItem` carrying the numbers the trainer may learn from: the node's tokens (replayed
exactly), our rewards and our replay's logprobs, never the node's claims.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from protocol.canonical import canonical_bytes
from protocol.envelope import Envelope, open_envelope, seal
from protocol.episodes import AnySubmission, EpisodeFeedItem, EpisodeSubmission
from protocol.errors import UngradableError
from protocol.replay import RereadRecords
from protocol.rollout import (
    FeedGroup,
    FeedItem,
    FeedSample,
    Outcome,
    Reason,
    Submission,
    Verdict,
    submission_hash,
)
from protocol.timing import StageTimer, stage
from validator.assignment import prompt_tokens
from validator.ledger import Decision, Ledger, Row

if TYPE_CHECKING:
    from environments import Task
    from models.loading import LoadedModel
    from protocol.identity import Identity
    from protocol.nonce import NonceCounter
    from toploc.validation import SequenceReport
    from validator.assignment import Assignment
    from validator.config import ValidatorConfig
    from validator.grading import Grader
    from validator.judge import Measurements
    from validator.stats import Stats

log = logging.getLogger(__name__)

SOFTWARE = "prime-validator/0.1"
"""Named in every evidence document: which rules judged it."""

STORED_AGE_S = 10 * 365 * 24 * 3600.0
"""Carried envelopes were sealed long ago; their age is not the point (the chain's windows are)."""


def _hex(data: bytes) -> str:
    return "0x" + data.hex()


def stored_submission(row: Row) -> AnySubmission:
    """A stored envelope's body (it passed every envelope check when it arrived), of its version."""
    envelope = Envelope.model_validate_json(row.envelope)
    if envelope.version == EpisodeSubmission.version:
        return EpisodeSubmission.model_validate(envelope.body)
    return Submission.model_validate(envelope.body)


def carried_submission(data: bytes, *, domain: str, node: str, max_bytes: int) -> AnySubmission:
    """A submission envelope someone else carries to us (an appeal, its evidence, a peer validator's stored row):
    in our run's `domain`, signed by `node`, of any age and never counted as a replay. `PrimeError` when not."""
    envelope = Envelope.from_bytes(data, max_bytes=max_bytes)
    body = open_envelope(envelope, domain=domain, replay_guard=RereadRecords(), expected_signer=node,
                         body_types=[Submission, EpisodeSubmission], max_age_s=STORED_AGE_S)
    assert isinstance(body, Submission | EpisodeSubmission)
    return body


class Verdicts:
    """Signs verdicts and feed items in this validator's name and builds the ledger's `Decision`s."""

    def __init__(self, cfg: ValidatorConfig, identity: Identity, nonces: NonceCounter, *, domain: str,
                 assignment: Assignment, grader: Grader, ledger: Ledger, stats: Stats) -> None:
        self.cfg, self.identity, self.nonces, self.domain = cfg, identity, nonces, domain
        self.assignment, self.grader, self.ledger, self.stats = assignment, grader, ledger, stats
        self.timer: StageTimer | None = None

    def _seal(self, body: Verdict | FeedItem | EpisodeFeedItem) -> bytes:
        with stage(self.timer, "verdict.seal"):
            return seal(self.identity, body, domain=self.domain, nonce=self.nonces.next(self.domain)).to_bytes()

    def decide(self, sub: AnySubmission, envelope_bytes: bytes, outcome: Outcome, reason: Reason, detail: str,
               measurements: Measurements | None = None, feed: FeedItem | EpisodeFeedItem | None = None,
               extra_evidence: dict[str, Any] | None = None) -> Decision:
        """The signed verdict (and for a hard one its evidence; for accepted work its feed item) as a ledger
        `Decision`."""
        key = self.assignment.work_key(sub.node, sub.policy_version, sub.counter)
        sub_hash = submission_hash(envelope_bytes)
        recorded = measurements.to_json() if measurements is not None else None
        evidence = evidence_hash = None
        if outcome is Outcome.REJECTED_HARD:
            evidence = canonical_bytes({
                "software": SOFTWARE, "work_key": _hex(key), "reason": reason.value, "detail": detail,
                # the envelope is stored once, in its ledger row (served at /v1/envelopes/{hash}): the
                # evidence names it by hash, which the hash of the evidence on chain then commits to
                "submission_hash": _hex(sub_hash), "measurements": recorded or {},
                "thresholds": self.cfg.checks.model_dump(mode="json"), "run": self.cfg.run.model_dump(mode="json"),
                **(extra_evidence or {})})
            evidence_hash = _hex(hashlib.sha256(evidence).digest())
        feed_bytes = self._seal(feed) if feed is not None else None
        self.stats.count(f"verdict_{outcome.value}")
        log.info("verdict %s %s node %s v%d #%d: %s%s", outcome.value, reason.value, sub.node, sub.policy_version,
                 sub.counter, detail, f" evidence {evidence_hash}" if evidence_hash else "")
        verdict = Verdict(
            run_id=self.cfg.run.run_id, work_key=key, node=sub.node, policy_version=sub.policy_version,
            counter=sub.counter, submission_hash=sub_hash, outcome=outcome, reason=reason,
            evidence_hash=bytes.fromhex(evidence_hash[2:]) if evidence_hash else None)
        return Decision(
            outcome=outcome.value, reason=reason.value, detail=detail, measurements=recorded,
            evidence=evidence, evidence_hash=evidence_hash, verdict=self._seal(verdict), feed_item=feed_bytes)

    def reject(self, sub: AnySubmission, envelope_bytes: bytes, reason: Reason, detail: str,
               measurements: Measurements | None = None, *, extra_evidence: dict[str, Any] | None = None) -> Decision:
        """A rejection: hard (slashed, with evidence) or soft as `reason` says."""
        outcome = Outcome.REJECTED_HARD if reason.hard else Outcome.REJECTED_SOFT
        return self.decide(sub, envelope_bytes, outcome, reason, detail, measurements, extra_evidence=extra_evidence)

    def equivocation(self, row: Row, second: AnySubmission, second_bytes: bytes) -> Row:
        """`second` (sealed as `second_bytes`) is a different payload the node signed for the assignment `row`
        holds: `row` becomes a hard `equivocation` verdict naming `second`, whose evidence holds both signed
        envelopes, so the evidence alone proves it (an appeal re-checks it from that document; `second` may be
        stored nowhere else). A row already hard stays as it is. Returns the row as it stands."""
        if row.outcome != Outcome.REJECTED_HARD.value:
            decision = self.reject(second, second_bytes, Reason.EQUIVOCATION,
                                   f"a second, different payload for assignment #{second.counter} at "
                                   f"v{second.policy_version}", extra_evidence={
                                       "submission": second_bytes.decode(), "first": row.envelope.decode(),
                                       "first_submission_hash": row.submission_hash})
            if not self.ledger.decide(row.work_key, decision):  # the checker decided it first
                self.ledger.redecide(row.work_key, decision)
        now = self.ledger.get(row.work_key)
        assert now is not None
        return now

    def soften_unreported(self, version: int) -> None:
        """This version's drift-band hard verdicts not yet on chain become `suspected_systemic` (the reporter
        holds hard verdicts for `systemic.window_s`, so the early ones of a wave are still here)."""
        for row in self.ledger.unreported_hard(version):  # a page at a time, never every envelope at once
            if row.outcome != Outcome.REJECTED_HARD.value or not json.loads(row.measurements or "{}").get("drift_band"):
                continue
            decision = self.decide(stored_submission(row), row.envelope, Outcome.REJECTED_SOFT,
                                   Reason.SUSPECTED_SYSTEMIC, f"was {row.reason}: {row.detail}")
            self.ledger.redecide(row.work_key, decision)

    def feed_item(self, loaded: LoadedModel, key: bytes, sub: Submission, tasks: list[Task],
                  rewards: list[list[float]], reports: list[SequenceReport]) -> FeedItem:
        """What the trainer learns from accepted (or restored) work: the node's tokens (replayed exactly),
        the rewards we recomputed and the sampling logprobs of *our* replay (`reports`, one per sample in
        order). The node's claimed logprobs passed `logprob_tolerance` and are never used: a node could
        move them anywhere inside it to steer the trainer's importance ratios. A sample that went on past an
        EOS our replay draws is fed as the replay drew it (`fed_sample`). Raises `UngradableError` when our
        grader fails on such a cut sample."""
        replayed = iter(reports)
        run = self.cfg.run
        return FeedItem(
            run_id=run.run_id, work_key=key, node=sub.node,
            policy_version=sub.policy_version, env=sub.env, env_version=sub.env_version,
            groups=tuple(FeedGroup(task_id=task.task_id, prompt_tokens=tuple(prompt_tokens(loaded, task)), samples=tuple(
                self.fed_sample(loaded, task, s.tokens, r, next(replayed))
                for s, r in zip(tr.samples, rs, strict=True)))
                for task, tr, rs in zip(tasks, sub.tasks, rewards, strict=True)))

    def fed_sample(self, loaded: LoadedModel, task: Task, tokens: tuple[int, ...], reward: float,
                   report: SequenceReport) -> FeedSample:
        """One sample for the trainer. Where our replay draws an EOS and the node's token there is not one (a
        near-tie EOS inside `checks.eos_tie_drift`, flipped by the node's float drift or skipped on purpose; a
        skip beyond it never gets here), the policy's sample ends at that EOS: the trainer gets the tokens before
        it, the EOS with our replay's logprob of it, and our grader's reward for that shorter completion. The
        tail the node generated after it is no draw of the policy (and is never paid, `judge.paid_tokens`); fed as
        it was, a node could lengthen its completions toward whatever the reward favours."""
        term, sampling = report.termination, report.sampling
        end = term.replay_end if term is not None else None
        eos = set(loaded.eos_token_ids)
        if end is None or sampling is None or sampling.winners[end - 1] not in eos or tokens[end - 1] in eos:
            return FeedSample(tokens=tokens, logprobs=tuple(report.logprobs), reward=reward)
        p = end - 1
        cut = (*tokens[:p], int(sampling.winners[p]))
        try:
            cut_reward = self.grader.grade(loaded, task, cut)
        except UngradableError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever our grader raises is our failure, never theirs
            raise UngradableError(f"grader failed on a sample cut at the replay's EOS: {type(exc).__name__}: "
                                  f"{exc}") from exc
        self.stats.count("feed_samples_cut_at_replay_eos")
        return FeedSample(tokens=cut, logprobs=(*report.logprobs[:p], report.winner_logprobs[p]), reward=cut_reward)
