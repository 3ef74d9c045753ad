"""The validator's core, wired: the rooms that take work in and judge it, on one ledger, chain view and weights.

`validator.service.Service` builds one for the process; a benchmark builds another on a ledger of its own
(`bench/validator.py`). The rooms: `validator.assignment`, `validator.intake`, `validator.checker` (with
`validator.guard` and `validator.grading`), `validator.judge` (pure) and `validator.verdicts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.envelope import NonceGuard
from protocol.identity import Identity
from protocol.nonce import NonceCounter
from protocol.rollout import submission_venue
from protocol.timing import StageTimer
from validator.assignment import Assignment
from validator.chainview import ChainView
from validator.checker import Checker
from validator.config import ValidatorConfig
from validator.grading import Grader
from validator.intake import Intake
from validator.judge import thresholds_of
from validator.ledger import Ledger
from validator.peers import PeerWatch
from validator.stats import Stats
from validator.verdicts import Verdicts
from validator.weights import WeightStore


@dataclass
class Core:
    """The rooms that take work in and judge it, wired on one ledger, chain view and set of weights."""

    stats: Stats
    assignment: Assignment
    grader: Grader
    verdicts: Verdicts
    checker: Checker
    intake: Intake

    @classmethod
    def build(cls, cfg: ValidatorConfig, identity: Identity, ledger: Ledger, chain: ChainView, weights: WeightStore,
              *, domain: str, replay_guard: NonceGuard, nonces: NonceCounter, peers: PeerWatch | None = None) -> Core:
        chain_id, pool = submission_venue(domain)  # bound into every work key and seed
        stats = Stats()
        thresholds = thresholds_of(cfg.checks)
        assignment = Assignment(cfg.run, chain_id=chain_id, pool=pool, me=identity.address,
                                validators=list(cfg.validators), ledger=ledger, chain=chain, stats=stats,
                                counter_gap=cfg.checks.counter_gap, peers=peers)
        grader = Grader(assignment)
        verdicts = Verdicts(cfg, identity, nonces, domain=domain, assignment=assignment, grader=grader, ledger=ledger,
                            stats=stats)
        checker = Checker(cfg, assignment=assignment, grader=grader, verdicts=verdicts, ledger=ledger, chain=chain,
                          weights=weights, thresholds=thresholds, stats=stats)
        intake = Intake(cfg, domain=domain, assignment=assignment, verdicts=verdicts, ledger=ledger, chain=chain,
                        replay_guard=replay_guard, thresholds=thresholds, stats=stats)
        return cls(stats, assignment, grader, verdicts, checker, intake)

    @property
    def timer(self) -> StageTimer | None:
        """The stage timer (`protocol.timing`) intake, checks and verdicts fill, or None (the default: no timing);
        the stages are listed in `validator.intake` and `validator.checker`."""
        return self.checker.timer

    @timer.setter
    def timer(self, timer: StageTimer | None) -> None:
        self.intake.timer = self.checker.timer = self.verdicts.timer = timer
