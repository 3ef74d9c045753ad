"""Per-precision tolerances (issue 35 item 5): the one lookup (`validator.judge.tolerances_of`) gives a submission
its declared precision's row of `checks.precision_tolerances`, never looser than the run-wide numbers; an old
node's submission (no `precision`) gets bf16's, today's; the table is pinned with the other verdict thresholds."""

from __future__ import annotations

import pytest

from protocol.errors import ConfigError
from protocol.precision import Tolerances
from protocol.rollout import Precision, SampleRollout, Submission, TaskRollouts
from protocol.run import RunSpec
from validator.config import CheckSettings, ValidatorConfig, load_config
from validator.judge import thresholds_hash, tolerances_of

NODE = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"  # anvil's public dev account 1 (an address, no key)


def _submission(precision: Precision | None) -> Submission:
    sample = SampleRollout(tokens=(5, 2), logprobs=(-0.5, -0.5), finish_reason="eos", reward=1.0, proofs=())
    return Submission(run_id="run", node=NODE, policy_version=1, manifest_hash=b"\1" * 32, counter=0, env="e",
                      env_version="1", precision=precision,
                      tasks=(TaskRollouts(task_id="0" * 32, samples=(sample,)),))


def _at(checks: CheckSettings, dtype: str = "float32") -> ValidatorConfig:
    """A validator with `checks` whose prefill runs in `dtype`."""
    return ValidatorConfig(checks=checks, dtype=dtype)  # type: ignore[arg-type]


def test_a_submission_gets_its_declared_precisions_row() -> None:
    checks = CheckSettings()
    fp32, bf16, old = (tolerances_of(_at(checks), _submission(p)) for p in (Precision.FP32, Precision.BF16, None))
    assert fp32 == Tolerances(sampling_margin=0.01, eos_tie_drift=0.01, near_tie_honest_rate=0.01)
    # bf16, and a node from before the field: exactly the single numbers every node got before
    assert bf16 == old == Tolerances(sampling_margin=checks.sampling_margin_tolerance,
                                     eos_tie_drift=checks.eos_tie_drift,
                                     near_tie_honest_rate=checks.near_tie_honest_rate)
    assert fp32.sampling_margin < 0.3 < bf16.sampling_margin  # a token steered at margin 0.3: fp32 no, bf16 yes


def test_no_row_is_looser_than_the_run_wide_numbers() -> None:
    fp32_run = CheckSettings(eos_tie_drift=0.01)  # an all-fp32 run, as the harness's validators
    assert tolerances_of(_at(fp32_run), _submission(Precision.BF16)).eos_tie_drift == 0.01
    assert tolerances_of(_at(fp32_run), _submission(None)).eos_tie_drift == 0.01
    no_fp16 = CheckSettings(precision_tolerances={Precision.FP32: Tolerances(
        sampling_margin=0.02, eos_tie_drift=0.02, near_tie_honest_rate=0.02)})
    assert tolerances_of(_at(no_fp16), _submission(Precision.FP16)).sampling_margin == no_fp16.sampling_margin_tolerance
    assert tolerances_of(_at(no_fp16), _submission(Precision.FP32)).sampling_margin == 0.02


def test_a_validator_that_replays_in_bf16_judges_fp32_work_with_bf16s_row() -> None:
    """An fp32 node's honest margins against a bf16 prefill reach bf16's (~0.3): the validator's choice of dtype
    must not make it a sampling mismatch (our failure is never the node's fault)."""
    checks = CheckSettings()
    at_bf16 = tolerances_of(_at(checks, "bfloat16"), _submission(Precision.FP32))
    assert at_bf16 == checks.tolerances(Precision.BF16) and at_bf16.sampling_margin > 0.3
    assert tolerances_of(_at(checks), _submission(Precision.FP32)).sampling_margin < 0.3


def test_the_table_is_pinned_with_the_verdict_thresholds() -> None:
    run = RunSpec()
    other = {"fp32": {"sampling_margin": 0.5, "eos_tie_drift": 0.5, "near_tie_honest_rate": 0.07}}
    looser = CheckSettings.model_validate({"precision_tolerances": other})
    assert thresholds_hash(looser, run) != thresholds_hash(CheckSettings(), run)  # appeals judged with it: refused
    assert looser.digest() != CheckSettings().digest()
    pinned = RunSpec(checks_hash=CheckSettings().digest()).model_dump_json()
    with pytest.raises(ConfigError, match="run.checks_hash pins the run's verdict thresholds"):
        load_config(["--run", pinned, "--checks.precision-tolerances",
                     '{"fp32": {"sampling_margin": 0.5, "eos_tie_drift": 0.5, "near_tie_honest_rate": 0.07}}'])
