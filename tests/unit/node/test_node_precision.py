"""A node declares the precision its engine computed in (issue 35 item 5), never a choice: the `models/` engine's
loaded dtype, named as the submission's `precision`."""

from __future__ import annotations

import pytest

from bench.loopback import MANIFEST_V0, RUN, TINY
from node.config import CpuEngineSettings
from node.engines import build_engine
from node.rollouts import build_submission
from protocol.errors import ModelError
from protocol.identity import Identity
from protocol.precision import precision_of
from protocol.rollout import Precision

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("dtype", "declared"), [("float32", Precision.FP32), ("bfloat16", Precision.BF16)])
def test_the_submission_declares_what_the_engine_computed_in(dtype: str, declared: Precision) -> None:
    engine = build_engine(CpuEngineSettings(dtype=dtype, threads=1), TINY)  # type: ignore[arg-type]
    assert engine.precision is declared
    run = RUN.model_copy(update={"tasks_per_batch": 1, "samples_per_task": 1, "max_new_tokens": 4})
    sub = build_submission(engine, run, Identity.create().address, 1, 0, MANIFEST_V0, chain_id=31337,
                           pool="0x" + "00" * 20)
    assert sub.precision is declared and sub.model_dump(mode="json")["precision"] == declared.value


def test_a_dtype_with_no_declared_precision_is_refused() -> None:
    assert precision_of("torch.float32") is Precision.FP32
    with pytest.raises(ModelError, match="no declared precision"):
        precision_of("float64")


def test_preflight_checks_the_work_against_the_tolerance_of_the_precision_it_will_declare() -> None:
    """The validator's `checks` as `/v1/info` serves them: the fp32 row, not the run-wide 0.5, is the limit an fp32
    engine's sampling margins are held to (a validator from before the table: its run-wide number)."""
    from node.preflight import run_preflight

    engine = build_engine(CpuEngineSettings(threads=1), TINY)
    row = {"sampling_margin": 0.02, "eos_tie_drift": 0.01, "near_tie_honest_rate": 0.01}
    report = run_preflight(engine, TINY, RUN, {"sampling_margin_tolerance": 0.5, "precision_tolerances": {
        "fp32": row, "bf16": {**row, "sampling_margin": 0.5}}}, batches=1)
    margin = next(c for c in report.checks if c.name.startswith("sampling margin"))
    assert (margin.name, margin.limit, margin.ok) == ("sampling margin (fp32)", 0.02, True), report.lines()
    old = run_preflight(engine, TINY, RUN, {"sampling_margin_tolerance": 0.3}, batches=1)
    assert next(c.limit for c in old.checks if c.name.startswith("sampling margin")) == 0.3
