"""The verdict rules: measurements in, a verdict out. Pure: no ledger, no chain, no model, no clock.

`judge` turns the replay's reports of one submission (`toploc.validation.SequenceReport`, one per sample, in
order) into a typed `SampleMeasurement` per sample and the submission's first failure, in order of precedence:
schema (a sample the replay could not measure), proof, sampling, termination, logprob. The same typed
measurements travel to the correlation guard (`validator.guard.drift_band`), the ledger and the evidence (as
`to_json()`, whose spelling is the stored format: evidence hashes on chain commit to it), appeals and the audit.

Also pure and here: the reward comparison, the thresholds a validator's checks config names (and their
hash), the tokens a node is paid for and the work units they are worth.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.canonical import canonical_bytes
from protocol.precision import precision_of
from protocol.rollout import Reason, SampleRollout, Submission

if TYPE_CHECKING:
    from protocol.episodes import AnySubmission
    from protocol.precision import Tolerances
    from protocol.rollout import RunSpec
    from toploc.thresholds import ToplocThresholds
    from toploc.validation import SequenceReport
    from validator.config import CheckSettings, ValidatorConfig

PRECEDENCE = (Reason.SCHEMA, Reason.PROOF_MISMATCH, Reason.SAMPLING_MISMATCH, Reason.TERMINATION,
              Reason.LOGPROB_MISMATCH)
"""When a submission fails several checks, the verdict names the first of these it fails."""

Failure = tuple[Reason, str]

PROOF_BYTES = 258
"""One TOPLOC proof chunk in the reference byte format."""


@dataclass(frozen=True)
class SampleMeasurement:
    """What the replay measured of one sample. `error` set: the sample could not be measured (malformed);
    every other field is then empty."""

    error: str | None = None
    toploc: tuple[tuple[int, float, float], ...] = ()
    """Per proof chunk: (exponent mismatches, mantissa error mean, median), the means rounded to 3 places."""
    failing_chunks: tuple[int, ...] = ()
    """Chunks over a TOPLOC threshold."""
    sampling_max_margin: float = 0.0
    """The largest margin by which a submitted token lost the seeded draw (inf: outside top-k/top-p)."""
    sampling_mismatches: tuple[int, ...] = ()
    """Positions whose margin exceeds the sampling tolerance."""
    termination: tuple[str, ...] = ()
    """The termination rules broken (`toploc.sampling_check.TerminationCheck.violations`)."""
    near_ties: int = 0
    """Positions where the submitted token lost the draw by no more than the tolerance."""
    eos_near_ties: tuple[tuple[int, float], ...] = ()
    """(position, margin) where the replay draws EOS and the node's token, not EOS, lost narrowly."""
    eos_skips: tuple[int, ...] = ()
    """Of those, the positions whose margin is beyond `checks.eos_tie_drift`: an EOS skipped on purpose."""
    paid_tokens: int | None = None
    """Tokens up to the replay's first EOS (what the node is paid for); None when not measured."""
    logprob_max_error: float = 0.0
    """The largest |claimed - replayed| sampling logprob."""

    @property
    def measured(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        """The stored spelling (ledger rows, evidence documents, `/v1/submissions`)."""
        if self.error is not None:
            return {"error": self.error}
        return {
            "error": None, "toploc": [list(c) for c in self.toploc], "failing_chunks": list(self.failing_chunks),
            "sampling_max_margin": self.sampling_max_margin, "sampling_mismatches": list(self.sampling_mismatches),
            "termination": list(self.termination), "near_ties": self.near_ties,
            "eos_near_ties": [[i, m] for i, m in self.eos_near_ties], "eos_skips": list(self.eos_skips),
            "paid_tokens": self.paid_tokens, "logprob_max_error": self.logprob_max_error,
        }

    @classmethod
    def from_json(cls, m: Mapping[str, Any]) -> SampleMeasurement:
        """Read back a stored measurement (`to_json`); keys a row of an older validator lacks read as empty."""
        if m.get("error") is not None:
            return cls(error=str(m["error"]))
        return cls(
            toploc=tuple((int(e), float(a), float(b)) for e, a, b in m.get("toploc") or ()),
            failing_chunks=tuple(int(i) for i in m.get("failing_chunks") or ()),
            sampling_max_margin=float(m.get("sampling_max_margin") or 0.0),
            sampling_mismatches=tuple(int(i) for i in m.get("sampling_mismatches") or ()),
            termination=tuple(str(t) for t in m.get("termination") or ()),
            near_ties=int(m.get("near_ties") or 0),
            eos_near_ties=tuple((int(i), float(x)) for i, x in m.get("eos_near_ties") or ()),
            eos_skips=tuple(int(i) for i in m.get("eos_skips") or ()),
            paid_tokens=None if m.get("paid_tokens") is None else int(m["paid_tokens"]),
            logprob_max_error=float(m.get("logprob_max_error") or 0.0),
        )


@dataclass(frozen=True)
class Measurements:
    """What a verdict records of one submission (the ledger's `measurements`, the evidence's). Fields left
    None are not recorded (a reward mismatch records only the rewards, a cheap check nothing)."""

    samples: tuple[SampleMeasurement, ...] = ()
    rewards: list[list[float]] | None = None
    """Our recomputed rewards, per task and sample."""
    thresholds_hash: str | None = None
    units: int | None = None
    """Work units the verdict is worth (paid tokens times `reporter.units_per_token`)."""
    near_ties: int | None = None
    eos_near_ties: int | None = None
    drift_band: bool | None = None
    """Set on hard verdicts of a measured submission: whether honest drift could explain the failure
    (`validator.guard.drift_band`); a softened row is marked False so it never counts as a failure again."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.samples:
            out["samples"] = [s.to_json() for s in self.samples]
        for name in ("rewards", "thresholds_hash", "units", "near_ties", "eos_near_ties", "drift_band"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, m: Mapping[str, Any] | None) -> Measurements:
        if not m:
            return cls()
        known = {"samples", "rewards", "thresholds_hash", "units", "near_ties", "eos_near_ties", "drift_band"}
        return cls(
            samples=tuple(SampleMeasurement.from_json(s) for s in m.get("samples") or ()),
            rewards=m.get("rewards"), thresholds_hash=m.get("thresholds_hash"), units=m.get("units"),
            near_ties=m.get("near_ties"), eos_near_ties=m.get("eos_near_ties"), drift_band=m.get("drift_band"),
            extra={k: v for k, v in m.items() if k not in known})


@dataclass(frozen=True)
class Judgement:
    """The first failure (None: every sample passes) and what was measured, one per sample."""

    failure: Failure | None
    samples: tuple[SampleMeasurement, ...]

    @property
    def near_ties(self) -> int:
        return sum(s.near_ties for s in self.samples)

    @property
    def eos_near_ties(self) -> int:
        return sum(len(s.eos_near_ties) for s in self.samples)


def measure_sample(rep: SequenceReport, claimed: SampleRollout, th: ToplocThresholds, eos_tie_drift: float
                   ) -> SampleMeasurement:
    """One replay report as a typed measurement (no verdict yet)."""
    if rep.error is not None:
        return SampleMeasurement(error=rep.error)
    sampling, term = rep.sampling, rep.termination
    assert sampling is not None and term is not None  # a measured report has both
    eos_ties = tuple((i, sampling.margins[i]) for i in term.eos_near_ties)
    return SampleMeasurement(
        toploc=tuple((p.exp_mismatches, round(p.mant_err_mean, 3), round(p.mant_err_median, 3)) for p in rep.proofs),
        failing_chunks=tuple(th.failing_chunks(rep.proofs)),
        sampling_max_margin=sampling.max_margin,
        sampling_mismatches=tuple(sampling.mismatch_positions),
        termination=tuple(term.violations),
        near_ties=len(sampling.near_ties),
        eos_near_ties=eos_ties,
        eos_skips=tuple(i for i, margin in eos_ties if margin > eos_tie_drift),
        paid_tokens=term.replay_end,
        logprob_max_error=max((abs(a - b) for a, b in zip(claimed.logprobs, rep.logprobs, strict=True)),
                              default=0.0),
    )


def sample_failures(j: int, m: SampleMeasurement, rep: SequenceReport, claimed: SampleRollout, th: ToplocThresholds,
                    logprob_tolerance: float, eos_tie_drift: float) -> dict[Reason, str]:
    """Every rule sample `j` breaks, with its detail."""
    if m.error is not None:
        return {Reason.SCHEMA: f"sample {j}: {m.error}"}
    sampling, term = rep.sampling, rep.termination
    assert sampling is not None and term is not None
    out: dict[Reason, str] = {}
    if m.failing_chunks:
        out[Reason.PROOF_MISMATCH] = f"sample {j}: chunks {list(m.failing_chunks)} over the TOPLOC limits"
    if th.sampling_failed(sampling):
        out[Reason.SAMPLING_MISMATCH] = (f"sample {j}: tokens at {list(m.sampling_mismatches)[:8]} were not the "
                                         "seeded draw")
    if m.termination or (claimed.finish_reason == "eos") != term.ends_with_eos:
        out[Reason.TERMINATION] = f"sample {j}: {list(m.termination)} (finish_reason {claimed.finish_reason})"
    elif m.eos_skips:
        out[Reason.TERMINATION] = (f"sample {j}: an EOS the replay ranks first was replaced at {list(m.eos_skips)[:8]} "
                                   f"by margins beyond the measured honest drift {eos_tie_drift}")
    if m.logprob_max_error > logprob_tolerance:
        out[Reason.LOGPROB_MISMATCH] = f"sample {j}: logprob off by {m.logprob_max_error:.3f}"
    return out


def judge(sub: Submission, reports: Sequence[SequenceReport], th: ToplocThresholds, logprob_tolerance: float,
          eos_tie_drift: float) -> Judgement:
    """The submission's first failure (in `PRECEDENCE`; for one reason, the first sample's detail) under
    thresholds `th`, and the typed measurements of every sample."""
    claimed = [s for tr in sub.tasks for s in tr.samples]
    samples: list[SampleMeasurement] = []
    failures: dict[Reason, str] = {}
    for j, (s, rep) in enumerate(zip(claimed, reports, strict=True)):
        m = measure_sample(rep, s, th, eos_tie_drift)
        samples.append(m)
        for reason, detail in sample_failures(j, m, rep, s, th, logprob_tolerance, eos_tie_drift).items():
            failures.setdefault(reason, detail)
    first = next(((r, failures[r]) for r in PRECEDENCE if r in failures), None)
    return Judgement(first, tuple(samples))


def reward_mismatch(sub: Submission, rewards: Sequence[Sequence[float]], tolerance: float) -> str | None:
    """The first sample whose claimed reward is not our recomputed one (within `tolerance`), or None."""
    for t, (tr, rs) in enumerate(zip(sub.tasks, rewards, strict=True)):
        for i, (s, r) in enumerate(zip(tr.samples, rs, strict=True)):
            if abs(s.reward - r) > tolerance:
                return f"task {t} sample {i}: claimed reward {s.reward}, recomputed {r}"
    return None


def paid_tokens(samples: Iterable[SampleMeasurement]) -> int | None:
    """Tokens a node is paid for, from the replay: each sample up to the replay's first EOS (tokens a node
    generated after an EOS it skipped are never paid). None when a sample could not be measured."""
    listed = list(samples)
    if not listed or any(m.paid_tokens is None for m in listed):
        return None
    return sum(int(m.paid_tokens or 0) for m in listed)


def units(sub: AnySubmission, units_per_token: float, paid: int | None = None) -> int:
    """Work units for `sub`: `paid` tokens (counted from the replay, see `paid_tokens`) or all its tokens."""
    return max(1, math.ceil((sub.n_tokens() if paid is None else paid) * units_per_token))


def thresholds_of(checks: CheckSettings) -> ToplocThresholds:
    """The TOPLOC and sampling thresholds a validator's `checks` config names."""
    from toploc.thresholds import ToplocThresholds

    return ToplocThresholds(
        max_exp_mismatches=checks.max_exp_mismatches, max_mant_err_mean=checks.max_mant_err_mean,
        max_mant_err_median=checks.max_mant_err_median, sampling_margin_tolerance=checks.sampling_margin_tolerance,
        max_sampling_mismatches=checks.max_sampling_mismatches)


def tolerances_of(cfg: ValidatorConfig, sub: AnySubmission) -> Tolerances:
    """The tolerances `sub` is judged with: the looser of its declared precision's row and the row of this
    validator's own prefill dtype (`cfg.dtype`: an fp32 node replayed in bf16 drifts like a bf16 node, and our
    replay's drift is never the node's fault) (`CheckSettings.tolerances`; a submission that declares none is
    judged as `protocol.rollout.UNDECLARED_PRECISION`). Every judging path asks this."""
    return cfg.checks.tolerances(sub.declared_precision, precision_of(cfg.dtype))


def thresholds_at(th: ToplocThresholds, tolerances: Tolerances) -> ToplocThresholds:
    """`th` with the sampling margin of `tolerances` (`tolerances_of`)."""
    return th.model_copy(update={"sampling_margin_tolerance": tolerances.sampling_margin})


def thresholds_hash(checks: CheckSettings, run: RunSpec) -> str:
    """What `/v1/info` and every accepted row name: the hash of the checks config and the run."""
    return "0x" + hashlib.sha256(canonical_bytes({
        "checks": checks.model_dump(mode="json"), "run": run.model_dump(mode="json")})).hexdigest()
