"""The model stage: received submissions checked with the claimed version's weights, one thread.

`check_pending()` leases received ledger rows, recomputes rewards, runs one batched prefill per weights version
(`toploc.validation.measure`: TOPLOC, sampling replay, termination, logprobs), has `validator.judge` decide,
lets the correlation guard (`validator.guard`) soften a drift-band failure when our own self-test fails, and
records the verdict (`validator.verdicts`). A failure on our side (weights not here, the model failing, a grader
that could not grade) is retried or soft, never hard.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from protocol.episodes import AnySubmission, EpisodeSubmission
from protocol.errors import ModelError, UngradableError
from protocol.rollout import Outcome, Reason, Submission
from protocol.timing import StageTimer, stage
from validator.assignment import prompt_tokens
from validator.episodes import EpisodeCheck, check_episodes, episode_feed_item
from validator.guard import SystemicGuard
from validator.judge import (
    Judgement,
    Measurements,
    judge,
    paid_tokens,
    reward_mismatch,
    thresholds_at,
    thresholds_hash,
    tolerances_of,
    units,
)
from validator.ledger import Decision, Ledger, Row, count_ties
from validator.near_tie_rule import ALPHA, beyond_honest, log_tail_bound
from validator.verdicts import stored_submission
from validator.weights import WeightsUnavailable

if TYPE_CHECKING:
    from environments import ChatRenderer, Task
    from models.loading import LoadedModel
    from toploc.thresholds import ToplocThresholds
    from toploc.validation import SequenceReport
    from validator.assignment import Assignment
    from validator.chainview import ChainView
    from validator.config import ValidatorConfig
    from validator.grading import Grader
    from validator.poolview import PoolView
    from validator.stats import Stats
    from validator.verdicts import Verdicts
    from validator.weights import WeightStore

log = logging.getLogger(__name__)

_EVIDENCE_ROWS = 1024
"""Rows holding near-ties a `near_tie_steering` evidence document names at most (the newest)."""


class Checker:
    """The model thread of one validator (see the module docstring)."""

    def __init__(self, cfg: ValidatorConfig, *, assignment: Assignment, grader: Grader, verdicts: Verdicts,
                 ledger: Ledger, chain: ChainView, weights: WeightStore, thresholds: ToplocThresholds,
                 stats: Stats) -> None:
        self.cfg, self.assignment, self.grader, self.verdicts = cfg, assignment, grader, verdicts
        self.ledger, self.chain, self.weights, self.thresholds, self.stats = ledger, chain, weights, thresholds, stats
        self.thresholds_hash = thresholds_hash(cfg.checks, cfg.run)
        self.guard = SystemicGuard(cfg, ledger, chain, thresholds, stats, self)
        self.timer: StageTimer | None = None
        self._renderer: tuple[object, ChatRenderer] | None = None
        self.pool: PoolView | None = None
        """The peers' signed notes (`validator.poolview`), set by the service when it has peers: the near-tie
        account a steering verdict judges is the pool's."""

    def check_pending(self, limit: int | None = None) -> int:
        """Check a batch of received rows; returns how many were decided."""
        with stage(self.timer, "check.ledger"):
            rows = self.ledger.claim(limit or self.cfg.checks.batch_submissions)
        by_version: dict[int, list[Row]] = {}
        for row in rows:
            by_version.setdefault(row.policy_version, []).append(row)
        return sum(self._check_version(version, group) for version, group in sorted(by_version.items()))

    def _ours_failed(self, row: Row, why: str, reason: Reason = Reason.VALIDATOR_ERROR) -> int:
        """Our failure: retry the row, or after `retries` attempts decide it soft. Never hard."""
        attempts = self.ledger.release(row.work_key, why)
        self.stats.count("own_failures")
        if attempts <= self.cfg.checks.retries:
            log.warning("could not check %s (attempt %d, will retry): %s", row.work_key, attempts, why)
            return 0
        self.ledger.decide(row.work_key, self.verdicts.reject(stored_submission(row), row.envelope, reason, why))
        return 1

    def _check_version(self, version: int, rows: list[Row]) -> int:
        try:
            loaded = self.weights.get(version)
        except WeightsUnavailable as exc:
            current = self.chain.current_version() or 0
            decided = 0
            for row in rows:
                if version < current - self.cfg.run.async_level:  # it will never come: soft, not the node's fault
                    self.ledger.decide(row.work_key, self.verdicts.reject(
                        stored_submission(row), row.envelope, Reason.WEIGHTS_UNAVAILABLE, str(exc)))
                    decided += 1
                else:
                    self.ledger.release(row.work_key, str(exc))
            return decided
        timer = self.timer
        with stage(timer, "check.parse"):
            subs = [(row, stored_submission(row)) for row in rows]
        prepared: list[tuple[Row, Submission, list[Task], list[list[float]]]] = []
        decided = 0
        for row, any_sub in subs:
            if isinstance(any_sub, EpisodeSubmission):
                decided += self._check_episodes(loaded, row, any_sub)
                continue
            sub = any_sub
            with stage(timer, "check.tasks"):
                tasks = self.assignment.tasks(sub.node, sub.policy_version, sub.counter)
            try:
                with stage(timer, "check.rewards"):
                    rewards = self.grader.rewards(loaded, sub, tasks)
            except UngradableError as exc:
                decided += self._ours_failed(row, f"grader: {exc}", Reason.UNGRADABLE)
                continue
            except Exception as exc:  # noqa: BLE001 - whatever our grader raises is our failure, never theirs
                decided += self._ours_failed(row, f"grader failed: {type(exc).__name__}: {exc}", Reason.UNGRADABLE)
                continue
            bad = reward_mismatch(sub, rewards, self.cfg.checks.reward_tolerance)
            if bad is not None:
                self.ledger.decide(row.work_key, self.verdicts.reject(sub, row.envelope, Reason.REWARD_MISMATCH, bad,
                                                                      Measurements(rewards=rewards)))
                decided += 1
                continue
            prepared.append((row, sub, tasks, rewards))
        if not prepared:
            return decided
        try:
            with stage(timer, "check.measure"):
                reports = self.measure(loaded, [(sub, tasks) for _, sub, tasks, _ in prepared])
        except (ModelError, RuntimeError, MemoryError) as exc:  # the model failing is ours, whatever it raised
            return decided + sum(self._ours_failed(row, f"model stage: {exc}") for row, *_ in prepared)
        for (row, sub, tasks, rewards), sub_reports in zip(prepared, reports, strict=True):
            try:
                with stage(timer, "check.verdict"):
                    decision = self._verdict(loaded, row, sub, tasks, rewards, sub_reports)
            except UngradableError as exc:  # grading a sample cut at the replay's EOS (feed_item) failed: ours
                decided += self._ours_failed(row, f"grader: {exc}", Reason.UNGRADABLE)
                continue
            with stage(timer, "check.ledger"):
                self.ledger.decide(row.work_key, decision)
            decided += 1
        return decided

    # -- multi-turn episodes (validator.episodes) ------------------------------------------------------------

    def episodes(self, loaded: LoadedModel, sub: EpisodeSubmission) -> EpisodeCheck:
        """`validator.episodes.check_episodes` of `sub` under this validator's run and checks (intake and appeals)."""
        from environments import ChatRenderer

        if self._renderer is None or self._renderer[0] is not loaded.tokenizer:
            self._renderer = (loaded.tokenizer, ChatRenderer(loaded.tokenizer))
        tasks = self.assignment.tasks(sub.node, sub.policy_version, sub.counter)
        c, tol = self.cfg.checks, tolerances_of(self.cfg, sub)
        return check_episodes(
            loaded, self._renderer[1], sub, tasks,
            env_seeds=[self.assignment.env_seed(sub, t.task_id) for t in tasks],
            seeds=[[self.assignment.sampling_seed(sub, t.task_id, i) for i in range(len(tr.samples))]
                   for t, tr in zip(tasks, sub.tasks, strict=True)],
            run=self.cfg.run, thresholds=thresholds_at(self.thresholds, tol), reward_tolerance=c.reward_tolerance,
            logprob_tolerance=c.logprob_tolerance, eos_tie_drift=tol.eos_tie_drift, batch_tokens=c.batch_tokens)

    def _check_episodes(self, loaded: LoadedModel, row: Row, sub: EpisodeSubmission) -> int:
        try:
            with stage(self.timer, "check.episodes"):
                got = self.episodes(loaded, sub)
        except UngradableError as exc:
            return self._ours_failed(row, f"environment: {exc}", Reason.UNGRADABLE)
        except (ModelError, RuntimeError, MemoryError) as exc:  # the model failing is ours, whatever it raised
            return self._ours_failed(row, f"model stage: {exc}")
        turns = tuple(m for per_episode in got.turns for m in per_episode)
        measurements = Measurements(
            samples=turns, rewards=got.rewards, thresholds_hash=self.thresholds_hash,
            units=units(sub, self.cfg.reporter.units_per_token, got.paid_tokens) if got.turns else None,
            near_ties=sum(m.near_ties for m in turns), eos_near_ties=sum(len(m.eos_near_ties) for m in turns))
        if got.failure is not None:
            reason, detail = got.failure
            if reason.hard and turns:
                in_band = self.guard.in_band(reason, turns)
                if self.guard.softens(sub, reason, turns):
                    detail = f"{reason.value} ({detail}) and our self-test of v{sub.policy_version} failed: " \
                             "suspecting ourselves"
                    reason, in_band = Reason.SUSPECTED_SYSTEMIC, False
                measurements = replace(measurements, drift_band=in_band)
            decision = self.verdicts.reject(sub, row.envelope, reason, detail, measurements)
        elif (steering := self.near_tie_steering(row.work_key, sub, measurements)) is not None:
            decision = self.verdicts.reject(sub, row.envelope, Reason.NEAR_TIE_STEERING, steering[0], measurements,
                                            extra_evidence=steering[1])
        else:
            feed = episode_feed_item(bytes.fromhex(row.work_key[2:]), sub, got)
            decision = self.verdicts.decide(sub, row.envelope, Outcome.ACCEPTED, Reason.ACCEPTED,
                                            f"{sub.n_samples()} episodes, {sub.n_tokens()} model tokens",
                                            measurements, feed=feed)
        self.ledger.decide(row.work_key, decision)
        return 1

    def judge(self, sub: Submission, reports: list[SequenceReport], thresholds: ToplocThresholds | None = None
              ) -> Judgement:
        """`validator.judge.judge` under this validator's checks (or `thresholds`), with the EOS-tie drift of `sub`'s
        declared precision (the reports were measured at its sampling margin: `measure`)."""
        c = self.cfg.checks
        return judge(sub, reports, thresholds or self.thresholds, c.logprob_tolerance,
                     tolerances_of(self.cfg, sub).eos_tie_drift)

    def _verdict(self, loaded: LoadedModel, row: Row, sub: Submission, tasks: list[Task],
                 rewards: list[list[float]], reports: list[SequenceReport]) -> Decision:
        judgement = self.judge(sub, reports)
        measurements = Measurements(
            samples=judgement.samples, rewards=rewards, thresholds_hash=self.thresholds_hash,
            units=units(sub, self.cfg.reporter.units_per_token, paid_tokens(judgement.samples)),
            near_ties=judgement.near_ties, eos_near_ties=judgement.eos_near_ties)
        self.stats.count("near_tie_disagreements", judgement.near_ties)
        self.stats.count("eos_near_ties", judgement.eos_near_ties)
        if judgement.failure is not None:
            reason, detail = judgement.failure
            if reason.hard:
                # whether honest drift could explain it; the guard may then blame ourselves (validator.guard)
                in_band = self.guard.in_band(reason, judgement.samples)
                if self.guard.softens(sub, reason, judgement.samples):
                    detail = f"{reason.value} ({detail}) and our self-test of v{sub.policy_version} failed: " \
                             "suspecting ourselves"
                    reason, in_band = Reason.SUSPECTED_SYSTEMIC, False  # a softened row never counts again
                measurements = replace(measurements, drift_band=in_band)
            return self.verdicts.reject(sub, row.envelope, reason, detail, measurements)
        steering = self.near_tie_steering(row.work_key, sub, measurements)
        if steering is not None:
            return self.verdicts.reject(sub, row.envelope, Reason.NEAR_TIE_STEERING, steering[0], measurements,
                                        extra_evidence=steering[1])
        feed = self.verdicts.feed_item(loaded, bytes.fromhex(row.work_key[2:]), sub, tasks, rewards, reports)
        return self.verdicts.decide(sub, row.envelope, Outcome.ACCEPTED, Reason.ACCEPTED,
                                    f"{sub.n_samples()} samples, {sub.n_tokens()} tokens", measurements, feed=feed)

    def near_tie_steering(self, work_key: str, sub: AnySubmission, measurements: Measurements
                          ) -> tuple[str, dict[str, Any]] | None:
        """(detail, evidence) of a `near_tie_steering` verdict when the node's account of accepted work, with this
        otherwise acceptable submission `sub` counted, holds more near-tie disagreements than an honest node's could
        (`validator.near_tie_rule` at the near-tie honest rate of `sub`'s declared precision); None when it does not. The account is the
        pool's (issue 35 item 7): this validator's kept tally plus every peer's in its fresh signed notes
        (`PoolView.near_tie_account`; this validator's alone without peers), so a node gains nothing by spreading
        its work. The evidence names the rows held here (a scan, read only when the verdict is due)."""
        node, p = sub.node, tolerances_of(self.cfg, sub).near_tie_honest_rate
        pooled = self.pool.near_tie_account(node) if self.pool is not None else self.ledger.near_tie_account(node)
        acc = [pooled[0], pooled[1], 0]
        count_ties(acc, measurements)
        tokens, near = acc[0], acc[1]
        if not beyond_honest(tokens, near, p):
            return None
        here = self.ledger.near_tie_evidence(node).plus(work_key, measurements)
        self.stats.count("near_tie_steering")
        bound = log_tail_bound(tokens, near, p)
        detail = (f"{near} near-tie disagreements in {tokens} paid tokens of accepted work in the pool "
                  f"(honest rate {p:g} per token: expected {p * tokens:.1f}; the honest tail bound "
                  f"exp({bound:.1f}) is below {ALPHA:g})")
        evidence = {"near_tie_account": {
            "tokens": tokens, "near_ties": near, "honest_rate": p, "precision": sub.declared_precision.value,
            "alpha": ALPHA,
            "log_tail_bound": bound, "rule": "chernoff_binomial_upper_tail",
            "here": {"tokens": here.tokens, "near_ties": here.near_ties},
            # the rows here that hold the near-ties (oldest dropped past the cap; their sum is in `here`)
            "rows": [list(r) for r in here.rows[-_EVIDENCE_ROWS:]]}}
        return detail, evidence

    def measure(self, loaded: LoadedModel, subs: list[tuple[Submission, list[Task]]],
                thresholds: ToplocThresholds | None = None) -> list[list[SequenceReport]]:
        """Our replay of every sample of `subs` (one batched prefill), grouped per submission."""
        from models.sampling import SamplingParams
        from toploc.validation import Rollout, measure

        run = self.cfg.run
        params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
        rollouts: list[Rollout] = []
        shape: list[int] = []
        for sub, tasks in subs:
            n, tolerance = 0, tolerances_of(self.cfg, sub).sampling_margin  # its declared precision's

            for task, tr in zip(tasks, sub.tasks, strict=True):
                prompt = prompt_tokens(loaded, task)
                for i, s in enumerate(tr.samples):
                    seed = self.assignment.sampling_seed(sub, task.task_id, i)
                    rollouts.append(Rollout(prompt, list(s.tokens), list(s.proofs), seed, run.max_new_tokens,
                                            tolerance=tolerance))
                    n += 1
            shape.append(n)
        reports = measure(loaded, rollouts, params, thresholds or self.thresholds,
                          batch_tokens=self.cfg.checks.batch_tokens, timer=self.timer)
        out, at = [], 0
        for n in shape:
            out.append(list(reports[at : at + n]))
            at += n
        return out

    # -- the guard's self-test (validator.guard.SelfTestHost) ----------------------------------------------

    def recheck(self, version: int, rows: list[Row]) -> list[tuple[Reason, str] | None]:
        """Stored submissions of `version` judged again with the current weights and thresholds (the guard's
        self-test); `WeightsUnavailable`, `ModelError` or the model's own errors when that cannot run."""
        loaded = self.weights.get(version)
        stored = [stored_submission(r) for r in rows]
        subs = [s for s in stored if isinstance(s, Submission)]
        reports = iter(self.measure(loaded, [(sub, self.assignment.tasks(sub.node, sub.policy_version, sub.counter))
                                             for sub in subs]))
        return [self.episodes(loaded, s).failure if isinstance(s, EpisodeSubmission)
                else self.judge(s, next(reports)).failure for s in stored]

    def soften_unreported(self, version: int) -> None:
        self.verdicts.soften_unreported(version)
