"""The correlation guard: when the validator may blame itself instead of a node.

A validator whose own weights, software or thresholds are wrong fails honest work, and must not slash
it. The guard that decides this must not be a switch attackers can flip, so it rests on three rules:

1. **Only the drift band can be softened** (`drift_band`). A failure is *possibly our fault* only
   when every measurement of the submission is a number honest hardware drift moves and each is
   within `systemic.drift_band_factor` times its threshold: TOPLOC chunk statistics just over the
   limits, sampling mismatches whose margin is a small multiple of the tolerance, a logprob error
   a small multiple of the tolerance. Everything else is deterministic proof of cheating and is
   never softened: the cheap checks (run, manifest, counter, tasks, schema), equivocation, a reward
   that is not the recomputed one, termination (an EOS skipped, a sequence cut short), malformed
   proofs, a token the replay ranks far below its winner, a chunk or logprob far outside any drift.
2. **Weight, not keys** (`SystemicGuard.established`). The guard compares the failing nodes' weight
   with the active nodes' weight, a node weighing its accepted submissions at this validator before
   the window (capped at `systemic.history_cap`) times its stake in units of the pool's minimum (capped
   at `systemic.stake_cap`, so one rich key is a few nodes, never the pool). A fresh Sybil key has no
   accepted history and weighs nothing, however many there are. Softened rows never count as failures,
   so the guard cannot feed itself.
3. **The validator tests itself before it blames itself** (`SystemicGuard.self_test`). When the
   weighted trigger fires it re-measures known-good work: submissions it accepted at that version from
   established nodes *outside the failing set*, drawn at random (so the nodes it suspects can neither
   supply nor time the work it re-checks), with the weights and thresholds it uses now. Our computation
   is deterministic, so work we accepted still passes unless our weights or thresholds changed: if most
   of it now fails, the version is *suspect* and its drift-band failures (including the unreported
   ones already recorded) become soft `suspected_systemic`. If it passes, drift-band failures are
   judged hard like any other. **With no known-good work to re-check the guard fails closed**: the
   validator cannot vouch for itself, so it cannot blame itself either, and drift-band failures are
   judged hard (a fresh version cheated on first by keys with history elsewhere is slashed; an honest
   node hit by our mistake appeals, and appeals exist to correct our mistakes). A suspect version is
   tested again after `systemic.window_s`.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol.errors import PrimeError
from protocol.rollout import Reason

if TYPE_CHECKING:
    from protocol.episodes import AnySubmission
    from toploc.thresholds import ToplocThresholds
    from validator.chainview import ChainView
    from validator.config import ValidatorConfig
    from validator.judge import SampleMeasurement
    from validator.ledger import Ledger, Row
    from validator.stats import Stats

log = logging.getLogger(__name__)

DRIFT_REASONS = frozenset({Reason.PROOF_MISMATCH, Reason.SAMPLING_MISMATCH, Reason.LOGPROB_MISMATCH})
"""The only reasons honest numeric drift can produce; every other hard reason is proof of cheating."""


def drift_band(reason: Reason, samples: Sequence[SampleMeasurement], th: ToplocThresholds,
               logprob_tolerance: float, factor: float) -> bool:
    """Whether a hard failure could be honest drift (see the module docstring, rule 1).

    `samples` is what `validator.judge.judge` measured; every sample must be measurable, end correctly, and
    stay within `factor` times each threshold it crosses."""
    if reason not in DRIFT_REASONS or not samples:
        return False
    for m in samples:
        if m.error is not None or m.termination or m.eos_skips:
            return False
        for i in m.failing_chunks:
            exp, mean, median = m.toploc[i]
            if not (exp <= factor * th.max_exp_mismatches and mean <= factor * th.max_mant_err_mean
                    and median <= factor * th.max_mant_err_median):
                return False
        margin = m.sampling_max_margin
        if m.sampling_mismatches and not (math.isfinite(margin) and margin <= factor * th.sampling_margin_tolerance):
            return False
        if not m.logprob_max_error <= factor * logprob_tolerance:
            return False
    return True


@dataclass
class SelfTest:
    """The outcome of one self-test of a policy version."""

    ok: bool
    """Our weights and thresholds still pass the known-good work (True when there was none: fail closed)."""
    detail: str
    at: float
    checked: int = 0
    """Known-good submissions re-measured (0: none to re-check, nothing vouched for either way)."""


class SelfTestHost(Protocol):
    """What the guard needs of the model stage (`validator.checker.Checker`) to test itself."""

    def recheck(self, version: int, rows: list[Row]) -> list[tuple[Reason, str] | None]:
        """Each stored submission's first failure (or None) re-measured with the current weights and thresholds."""
        ...

    def soften_unreported(self, version: int) -> None:
        """The version's drift-band hard verdicts not yet on chain become `suspected_systemic`."""
        ...


class SystemicGuard:
    """Decides whether a drift-band failure is softened (see the module docstring)."""

    def __init__(self, cfg: ValidatorConfig, ledger: Ledger, chain: ChainView, thresholds: ToplocThresholds,
                 stats: Stats, host: SelfTestHost) -> None:
        self.checks, self.cfg = cfg.checks, cfg.systemic
        self.ledger, self.chain, self.thresholds, self.stats, self.host = ledger, chain, thresholds, stats, host
        self._suspect: dict[int, SelfTest] = {}
        self._passed: dict[int, SelfTest] = {}
        self._lock = threading.Lock()

    def weight(self, node: str, accepted: int) -> float:
        """A node's weight: its accepted history (capped) times its stake in units of the pool minimum."""
        if accepted <= 0:
            return 0.0
        stake, minimum = self.chain.stake(node), self.chain.min_stake
        units = min(self.cfg.stake_cap, max(1.0, stake / minimum)) if minimum > 0 else 1.0
        return min(accepted, self.cfg.history_cap) * units

    def established(self, nodes: set[str], before: float) -> dict[str, float]:
        history = self.ledger.accepted_before(sorted(nodes), before)
        return {n: self.weight(n, history.get(n, 0)) for n in nodes}

    def in_band(self, reason: Reason, samples: Sequence[SampleMeasurement]) -> bool:
        """`drift_band` under this validator's thresholds. The sampling margin is the run-wide one, not the
        submission's precision's row: the band asks whether *our* side could explain the failure (weights gone
        wrong, another machine), and our error is not bounded by the node's precision. At fp32's row (0.01) the
        band would be 0.02, and a validator whose own weights went wrong would slash every honest fp32 node
        (`test_guard`). A steering node is still hard: one node alone never pulls the trigger, and the self-test
        re-judges known-good work at each row's own precision."""
        return drift_band(reason, samples, self.thresholds, self.checks.logprob_tolerance, self.cfg.drift_band_factor)

    def softens(self, sub: AnySubmission, reason: Reason, samples: Sequence[SampleMeasurement],
                now: float | None = None) -> bool:
        """True when this hard failure is to be recorded as soft `suspected_systemic`."""
        s = self.cfg
        if not self.in_band(reason, samples):
            return False
        t = time.time() if now is None else now
        version = sub.policy_version
        since = t - s.window_s
        with self._lock:
            suspect = self._suspect.get(version)
            if suspect is not None and t - suspect.at < s.window_s:
                self.stats.count("systemic_suspected")
                return True
            passed = self._passed.get(version)
        failing = set(self.ledger.drift_failures_since(version, since)) | {sub.node}
        if suspect is None:  # not suspect yet: only the weighted trigger starts a self-test
            if passed is not None and t - passed.at < s.window_s:
                return False
            # a failing node is active, whenever its row was received (one received before the window and
            # decided in it is in `failing` only: weighing it must not raise in the checker thread)
            active = set(self.ledger.active_nodes_since(since)) | failing
            weights = self.established(active, since)
            w_fail = sum(weights[n] for n in failing)
            w_active = sum(weights.values())
            heavy = sum(1 for n in failing if weights[n] > 0)
            if heavy < s.min_nodes or w_active <= 0 or w_fail / w_active < s.fraction:
                return False
            log.warning("correlation guard: %d established nodes (weight %.0f of %.0f active) fail in the drift band "
                        "at v%d within %.0f s: testing ourselves", heavy, w_fail, w_active, version, s.window_s)
        result = self.self_test(version, t, failing)
        if not result.checked:  # nothing to vouch for us: fail closed, and test again once there is
            self.stats.count("self_test_no_known_good")
            log.warning("self-test of v%d: %s; drift-band failures are judged hard (appeals correct our mistakes)",
                        version, result.detail)
            return False
        with self._lock:
            if result.ok:
                self._suspect.pop(version, None)
                self._passed[version] = result
            else:
                self._suspect[version] = result
                self._passed.pop(version, None)
        if result.ok:
            self.stats.count("self_test_passed")
            log.info("self-test of v%d passed (%s): drift-band failures are judged hard", version, result.detail)
            return False
        self.stats.count("self_test_failed")
        self.stats.count("systemic_suspected")
        log.error("SYSTEMIC: self-test of v%d failed (%s); drift-band failures of this version are soft until a "
                  "self-test passes (check our weights, software and thresholds)", version, result.detail)
        self.host.soften_unreported(version)
        return True

    def self_test(self, version: int, now: float, failing: set[str] | None = None) -> SelfTest:
        """Re-measure up to `systemic.self_test_submissions` known-good submissions of `version` (accepted, by
        established nodes outside `failing`, drawn at random) with our current weights and thresholds."""
        n = self.cfg.self_test_submissions
        rows = self.ledger.random_accepted(version, 8 * n, excluding=sorted(failing or ()))
        if rows:
            weights = self.established({r.node for r in rows}, now - self.cfg.window_s)
            rows = [r for r in rows if weights[r.node] > 0]
            rows = random.SystemRandom().sample(rows, min(n, len(rows)))
        if not rows:
            return SelfTest(True, f"no known-good work of v{version} outside the failing nodes to re-check", now)
        try:
            results = self.host.recheck(version, rows)
        except (PrimeError, RuntimeError, MemoryError) as exc:  # weights gone, the model failing: ours, not theirs
            return SelfTest(False, f"could not re-measure known-good work: {exc}", now, len(rows))
        failed = [f"{row.work_key[:10]}: {failure[0].value}" for row, failure in zip(rows, results, strict=True)
                  if failure is not None]
        detail = f"{len(rows) - len(failed)} of {len(rows)} known-good submissions still pass" + (
            f" ({'; '.join(failed)})" if failed else "")
        return SelfTest(2 * len(failed) <= len(rows), detail, now, len(rows))
