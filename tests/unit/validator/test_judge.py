"""The verdict rules (`validator.judge`) and the drift band (`validator.guard.drift_band`), on hand-built replay
reports: no model, no chain, no server. Each test states one rule of docs/protocol/verdicts.md."""

from __future__ import annotations

import json
import math

import pytest

from protocol.rollout import Reason, SampleRollout, Submission, TaskRollouts
from toploc.proofs import VerificationResult
from toploc.sampling_check import SamplingCheck, TerminationCheck
from toploc.thresholds import ToplocThresholds
from toploc.validation import SequenceReport
from validator.config import CheckSettings
from validator.guard import drift_band
from validator.judge import (
    PRECEDENCE,
    Measurements,
    SampleMeasurement,
    judge,
    paid_tokens,
    reward_mismatch,
    thresholds_hash,
    thresholds_of,
    units,
)

TH = ToplocThresholds(max_exp_mismatches=38, max_mant_err_mean=10.0, max_mant_err_median=8.0,
                      sampling_margin_tolerance=0.5, max_sampling_mismatches=0)
LP_TOL = 0.0625  # exact in binary, so "at the tolerance" is exactly at it
EOS_DRIFT = 0.5
EOS = 2
NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil's public dev account 1 (an address, no key)


def _sample(n: int = 4, *, eos: bool = True, reward: float = 1.0, logprobs: tuple[float, ...] | None = None
            ) -> SampleRollout:
    tokens = (*range(5, 5 + n - 1), EOS if eos else 99)
    return SampleRollout(tokens=tokens, logprobs=logprobs or (-0.5,) * n, finish_reason="eos" if eos else "length",
                         reward=reward, proofs=(b"\0" * 258,))


def _submission(*samples: SampleRollout) -> Submission:
    return Submission(run_id="run", node=NODE, policy_version=1, manifest_hash=b"\1" * 32, counter=0, env="e",
                      env_version="1", tasks=(TaskRollouts(task_id="0" * 32, samples=samples or (_sample(),)),))


def _report(n: int = 4, *, chunk: tuple[int, float, float] = (0, 0.0, 0.0), margins: tuple[float, ...] | None = None,
            mismatches: tuple[int, ...] = (), near_ties: tuple[int, ...] = (), eos_at_end: bool = True,
            stopped_early: bool = False, eos_near_ties: tuple[int, ...] = (), logprobs: tuple[float, ...] | None = None,
            replay_end: int | None = None) -> SequenceReport:
    margins = margins or (0.0,) * n
    return SequenceReport(
        proofs=(VerificationResult(*chunk),),
        sampling=SamplingCheck(margins=margins, winners=(7,) * n, mismatch_positions=mismatches,
                               tolerance=TH.sampling_margin_tolerance, near_ties=near_ties),
        termination=TerminationCheck(length=n, max_tokens=16, ends_with_eos=eos_at_end, eos_before_end=(),
                                     stopped_early=stopped_early, over_limit=False, missed_eos=(),
                                     eos_near_ties=eos_near_ties, replay_end=n if replay_end is None else replay_end),
        logprobs=logprobs or (-0.5,) * n)


def _judge(sub: Submission, *reports: SequenceReport):  # type: ignore[no-untyped-def]
    return judge(sub, list(reports), TH, LP_TOL, EOS_DRIFT)


def test_honest_work_passes_and_every_sample_is_measured() -> None:
    j = _judge(_submission(_sample(), _sample()), _report(), _report())
    assert j.failure is None
    assert [s.measured for s in j.samples] == [True, True]
    assert j.samples[0].toploc == ((0, 0.0, 0.0),) and j.samples[0].paid_tokens == 4


@pytest.mark.parametrize(("report", "reason"), [
    (_report(chunk=(39, 0.0, 0.0)), Reason.PROOF_MISMATCH),           # one exponent mismatch over the limit
    (_report(chunk=(0, 10.001, 0.0)), Reason.PROOF_MISMATCH),         # mantissa mean just over
    (_report(chunk=(0, 0.0, 8.5)), Reason.PROOF_MISMATCH),            # mantissa median over
    (_report(margins=(0.0, 0.6, 0.0, 0.0), mismatches=(1,)), Reason.SAMPLING_MISMATCH),
    (_report(stopped_early=True, eos_at_end=False), Reason.TERMINATION),
    (_report(logprobs=(-0.5, -0.5, -0.5, -0.6)), Reason.LOGPROB_MISMATCH),
    (SequenceReport(proofs=(), sampling=None, termination=None, error="token 9999 outside the vocabulary"),
     Reason.SCHEMA),
])
def test_each_rule_fails_with_its_reason(report: SequenceReport, reason: Reason) -> None:
    j = _judge(_submission(), report)
    assert j.failure is not None and j.failure[0] is reason, j.failure
    assert "sample 0" in j.failure[1]


def test_at_the_thresholds_work_still_passes() -> None:
    """The limits are inclusive: a chunk at exactly the limits, a margin at the tolerance, the logprob error at
    the tolerance all pass (honest drift reaches them)."""
    j = _judge(_submission(), _report(chunk=(38, 10.0, 8.0), margins=(0.0, 0.5, 0.0, 0.0), near_ties=(1,),
                                      logprobs=(-0.5, -0.5, -0.5, -0.5625)))
    assert j.failure is None, j.failure
    assert j.near_ties == 1


def test_a_claimed_eos_the_sequence_does_not_end_with_is_termination() -> None:
    """`finish_reason` must say how the replay saw the sequence end."""
    j = _judge(_submission(_sample(eos=True)), _report(eos_at_end=False))
    assert j.failure is not None and j.failure[0] is Reason.TERMINATION


def test_an_eos_skipped_beyond_the_honest_drift_is_termination_and_within_it_is_not() -> None:
    inside = _judge(_submission(), _report(margins=(0.0, 0.4, 0.0, 0.0), eos_near_ties=(1,), near_ties=(1,)))
    assert inside.failure is None and inside.samples[0].eos_skips == () and inside.eos_near_ties == 1
    # a margin within the sampling tolerance but beyond eos_tie_drift: someone chose to go on
    strict = judge(_submission(), [_report(margins=(0.0, 0.45, 0.0, 0.0), eos_near_ties=(1,), near_ties=(1,))],
                   TH, LP_TOL, 0.4)
    assert strict.failure is not None and strict.failure[0] is Reason.TERMINATION
    assert strict.samples[0].eos_skips == (1,)


def test_the_first_failing_reason_in_precedence_wins_whatever_the_sample_order() -> None:
    assert PRECEDENCE[:2] == (Reason.SCHEMA, Reason.PROOF_MISMATCH)
    sub = _submission(_sample(), _sample(), _sample())
    j = _judge(sub, _report(logprobs=(-0.5, -0.5, -0.5, -0.9)),
               _report(margins=(0.0, 0.9, 0.0, 0.0), mismatches=(1,)), _report(chunk=(100, 0.0, 0.0)))
    assert j.failure is not None
    assert j.failure[0] is Reason.PROOF_MISMATCH and j.failure[1].startswith("sample 2")


def test_measurements_keep_their_stored_spelling_and_read_back() -> None:
    j = _judge(_submission(), _report(chunk=(3, 1.23456, 2.0), margins=(0.0, math.inf, 0.0, 0.0), mismatches=(1,)))
    m = Measurements(samples=j.samples, rewards=[[1.0]], units=4, near_ties=0, eos_near_ties=0, drift_band=False)
    stored = json.loads(json.dumps(m.to_json()))
    assert set(stored["samples"][0]) == {"error", "toploc", "failing_chunks", "sampling_max_margin",
                                         "sampling_mismatches", "termination", "near_ties", "eos_near_ties",
                                         "eos_skips", "paid_tokens", "logprob_max_error"}
    assert stored["samples"][0]["toploc"] == [[3, 1.235, 2.0]]
    assert Measurements.from_json(stored) == m
    assert SampleMeasurement.from_json({"error": "bad"}).to_json() == {"error": "bad"}
    assert Measurements(rewards=[[0.5]]).to_json() == {"rewards": [[0.5]]}  # what a reward mismatch records


def test_rewards_are_compared_within_the_tolerance() -> None:
    sub = _submission(_sample(reward=1.0), _sample(reward=0.25))
    assert reward_mismatch(sub, [[1.0, 0.25]], 1e-6) is None
    assert reward_mismatch(sub, [[1.0, 0.2500001]], 1e-6) is None
    assert reward_mismatch(sub, [[1.0, 0.0]], 1e-6) == "task 0 sample 1: claimed reward 0.25, recomputed 0.0"


def test_a_node_is_paid_the_tokens_the_replay_draws_not_its_own() -> None:
    j = _judge(_submission(_sample(8), _sample(4)), _report(8, replay_end=5), _report(4))
    assert paid_tokens(j.samples) == 9
    assert units(_submission(_sample(8), _sample(4)), 0.5, paid_tokens(j.samples)) == 5  # ceil(9 * 0.5)
    assert paid_tokens([SampleMeasurement(error="x")]) is None
    assert units(_submission(_sample(8)), 1.0, None) == 8  # not measured: every token


def test_the_thresholds_and_their_hash_follow_the_checks_config() -> None:
    from protocol.rollout import RunSpec

    checks = CheckSettings()
    th = thresholds_of(checks)
    assert th.max_exp_mismatches == checks.max_exp_mismatches
    assert th.sampling_margin_tolerance == checks.sampling_margin_tolerance
    run = RunSpec(run_id="r", env="reverse-text", env_version="1")
    assert thresholds_hash(checks, run) == thresholds_hash(CheckSettings(), run)
    assert thresholds_hash(checks, run) != thresholds_hash(CheckSettings(max_exp_mismatches=1), run)


# -- the drift band: which hard failures honest drift could explain --------------------------------------------

FACTOR = 2.0


def _band(reason: Reason, *reports: SequenceReport) -> bool:
    j = _judge(_submission(*[_sample() for _ in reports]), *reports)
    return drift_band(reason, j.samples, TH, LP_TOL, FACTOR)


def test_drift_band_holds_failures_just_over_a_threshold() -> None:
    assert _band(Reason.PROOF_MISMATCH, _report(chunk=(60, 12.0, 9.0)))
    assert _band(Reason.SAMPLING_MISMATCH, _report(margins=(0.0, 0.9, 0.0, 0.0), mismatches=(1,)))
    assert _band(Reason.LOGPROB_MISMATCH, _report(logprobs=(-0.5, -0.5, -0.5, -0.59)))
    assert _band(Reason.PROOF_MISMATCH, _report(chunk=(76, 20.0, 16.0)))  # exactly factor x each limit


@pytest.mark.parametrize(("reason", "report"), [
    (Reason.PROOF_MISMATCH, _report(chunk=(77, 0.0, 0.0))),              # exponents beyond factor x the limit
    (Reason.PROOF_MISMATCH, _report(chunk=(0, 25.0, 0.0))),
    (Reason.SAMPLING_MISMATCH, _report(margins=(0.0, 1.5, 0.0, 0.0), mismatches=(1,))),
    (Reason.SAMPLING_MISMATCH, _report(margins=(0.0, math.inf, 0.0, 0.0), mismatches=(1,))),  # outside top-k
    (Reason.LOGPROB_MISMATCH, _report(logprobs=(-0.5, -0.5, -0.5, -0.7))),
    (Reason.PROOF_MISMATCH, _report(chunk=(40, 0.0, 0.0), stopped_early=True, eos_at_end=False)),  # also cut short
    (Reason.TERMINATION, _report(stopped_early=True, eos_at_end=False)),  # never a drift reason
    (Reason.REWARD_MISMATCH, _report()),
    (Reason.EQUIVOCATION, _report()),
])
def test_drift_band_refuses_what_drift_cannot_explain(reason: Reason, report: SequenceReport) -> None:
    assert not _band(reason, report)


def test_drift_band_needs_every_sample_in_the_band() -> None:
    assert not _band(Reason.PROOF_MISMATCH, _report(chunk=(40, 0.0, 0.0)), _report(chunk=(200, 0.0, 0.0)))
    assert not _band(Reason.PROOF_MISMATCH, _report(chunk=(40, 0.0, 0.0)),
                     SequenceReport(proofs=(), sampling=None, termination=None, error="malformed"))
    assert not drift_band(Reason.PROOF_MISMATCH, (), TH, LP_TOL, FACTOR)  # nothing measured: nothing to excuse
    eos_skip = judge(_submission(), [_report(chunk=(40, 0.0, 0.0), margins=(0.0, 0.45, 0.0, 0.0),
                                             eos_near_ties=(1,))], TH, LP_TOL, 0.4)
    assert not drift_band(Reason.PROOF_MISMATCH, eos_skip.samples, TH, LP_TOL, FACTOR)
