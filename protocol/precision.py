"""Sampling tolerances per declared compute precision (issue 35 item 5): the one lookup of what a submission that
declares precision p is judged with. The validator's `checks.precision_tolerances` holds the table; a node's
pre-flight reads the same table from the validator's `/v1/info` `checks` and checks its work against its own row.

A row is never looser than the validator's run-wide numbers (`checks.sampling_margin_tolerance`, `eos_tie_drift`,
`near_tie_honest_rate`, the `ceiling` here): those stay what an operator turns down for a run (an all-fp32 run's
`eos_tie_drift = 0.01`), and a precision the table does not name gets exactly them, the single tolerance every
node got before precisions were declared.

The replay's own precision counts too: an fp32 node's work replayed by a validator that prefills in bf16 drifts
like a bf16 node's, so work is judged with the looser of its declared precision's row and the replay's row (a
validator's choice of dtype is never the node's fault).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import ModelError
from protocol.rollout import Precision

PRECISIONS: dict[str, Precision] = {"float32": Precision.FP32, "bfloat16": Precision.BF16, "float16": Precision.FP16}
"""The precision of each compute dtype an engine or a validator's prefill can run in (torch's and vLLM's names)."""


def precision_of(dtype: str) -> Precision:
    """The precision of compute dtype `dtype` (`float32`, `torch.bfloat16`, ...); `ModelError` for one the
    protocol has no tolerance for (a node never declares a precision it did not compute in)."""
    name = str(dtype).removeprefix("torch.")
    if name not in PRECISIONS:
        raise ModelError(f"compute dtype {dtype!r} has no declared precision (one of {sorted(PRECISIONS)})")
    return PRECISIONS[name]


class Tolerances(BaseModel):
    """The honest drift a replay of one precision's work allows."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    sampling_margin: float = Field(ge=0.0)
    """A token is a sampling mismatch when the replayed winner beats it by more than this."""
    eos_tie_drift: float = Field(ge=0.0)
    """A skipped near-tie EOS whose margin is above this is a hard `termination` failure."""
    near_tie_honest_rate: float = Field(gt=0.0, lt=1.0)
    """Honest near-tie disagreements per paid token (the `near_tie_steering` rule's rate)."""

    def or_looser(self, other: Tolerances) -> Tolerances:
        """Each number the looser of the two (the drift between two precisions is the larger one's)."""
        return Tolerances(sampling_margin=max(self.sampling_margin, other.sampling_margin),
                          eos_tie_drift=max(self.eos_tie_drift, other.eos_tie_drift),
                          near_tie_honest_rate=max(self.near_tie_honest_rate, other.near_tie_honest_rate))

    def at_most(self, ceiling: Tolerances) -> Tolerances:
        """Each number no looser than `ceiling`'s."""
        return Tolerances(sampling_margin=min(self.sampling_margin, ceiling.sampling_margin),
                          eos_tie_drift=min(self.eos_tie_drift, ceiling.eos_tie_drift),
                          near_tie_honest_rate=min(self.near_tie_honest_rate, ceiling.near_tie_honest_rate))


DEFAULT_PRECISION_TOLERANCES: dict[Precision, Tolerances] = {
    # fp32 nodes: 0 near-ties, honest margins 0.0 (tiny model, 3,513 tokens; SmolLM2, 890 tokens; bench.near_ties);
    # small but not zero, so a validator on another CPU (another matmul order) still agrees
    Precision.FP32: Tolerances(sampling_margin=0.01, eos_tie_drift=0.01, near_tie_honest_rate=0.01),
    # bf16 nodes: margins up to ~0.3 against a replay, 18 near-ties in 837 SmolLM2 tokens: today's numbers
    Precision.BF16: Tolerances(sampling_margin=0.5, eos_tie_drift=0.5, near_tie_honest_rate=0.07),
    # fp16: not measured; it gets bf16's row (fp16 has more mantissa bits than bf16, so no larger drift)
    Precision.FP16: Tolerances(sampling_margin=0.5, eos_tie_drift=0.5, near_tie_honest_rate=0.07),
}


def tolerances_for(table: Mapping[Precision, Tolerances], ceiling: Tolerances, precision: Precision,
                   replay: Precision = Precision.FP32) -> Tolerances:
    """What work declared in `precision` and replayed in `replay` is judged with: the looser of their rows of
    `table`, no looser than `ceiling`; `ceiling` itself when the table does not name one of them."""
    row, theirs = table.get(precision), table.get(replay)
    if row is None or theirs is None:
        return ceiling
    return row.or_looser(theirs).at_most(ceiling)


def tolerances_from_checks(checks: Mapping[str, Any], precision: Precision) -> Tolerances:
    """`tolerances_for` from a validator's `checks` as `/v1/info` serves them (a node's pre-flight, against its
    own fp32 replay); a validator from before the table gets its run-wide numbers, as it judges."""
    ceiling = Tolerances(sampling_margin=float(checks.get("sampling_margin_tolerance", 0.5)),
                         eos_tie_drift=float(checks.get("eos_tie_drift", 0.5)),
                         near_tie_honest_rate=float(checks.get("near_tie_honest_rate", 0.07)))
    raw = checks.get("precision_tolerances") or {}
    table = {Precision(p): Tolerances.model_validate(row) for p, row in raw.items() if p in set(Precision)}
    return tolerances_for(table, ceiling, precision)
