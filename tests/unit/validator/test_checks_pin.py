"""`run.checks_hash` pins a run's verdict thresholds: a validator configured with others refuses to start, so
every verdict and every appeal against one is judged with the same thresholds."""

from __future__ import annotations

import pytest

from protocol.errors import ConfigError
from protocol.run import RunSpec
from validator.config import CheckSettings, load_config

PINNED = CheckSettings().digest()


def _argv(pin: str, *flags: str) -> list[str]:
    return ["--run", RunSpec(checks_hash=pin).model_dump_json(), *flags]


def test_the_runs_thresholds_start() -> None:
    cfg = load_config(_argv(PINNED))
    assert cfg.run.checks_hash == cfg.checks.digest() == PINNED


def test_batch_sizes_and_retries_are_not_verdicts() -> None:
    cfg = load_config(_argv(PINNED, "--checks.batch-tokens", "1024", "--checks.batch-submissions", "2",
                            "--checks.retries", "0"))
    assert cfg.checks.digest() == PINNED


@pytest.mark.parametrize(("flag", "value"), [
    ("--checks.max-exp-mismatches", "60"), ("--checks.sampling-margin-tolerance", "0.9"),
    ("--checks.logprob-tolerance", "2.0"), ("--checks.eos-tie-drift", "0.01"), ("--checks.counter-gap", "8"),
])
def test_other_thresholds_refuse_to_start(flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match="run.checks_hash pins the run's verdict thresholds"):
        load_config(_argv(PINNED, flag, value))


def test_an_unpinned_run_takes_any_thresholds() -> None:
    cfg = load_config(["--checks.max-exp-mismatches", "60"])
    assert cfg.run.checks_hash is None and cfg.checks.digest() != PINNED
