"""Pre-flight: would honest work from this machine pass the validator's checks?

A few assignments are generated exactly as `join` would (this machine's engine, dtype and compute
path; seeds of a throwaway address, nothing signed or sent), then measured the way a validator does:
one prefill with the run's model in the validator's dtype (`toploc.validation.measure`), the run's
thresholds (from a validator's `/v1/info`, else the defaults), rewards recomputed. The report says
how far the worst value of each measurement is from its threshold; `join` refuses to stake when a
threshold is crossed (`--force` overrides), because every crossing would be a slash.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from environments import MultiTurnEnvironment
from environments import get as get_environment
from node.engines import InferenceEngine
from node.episodes import build_episode_submission
from node.rollouts import build_submission, prompt_ids
from protocol.episodes import AnySubmission, EpisodeRollout, TaskEpisodes, TurnRollout
from protocol.identity import Identity
from protocol.model_spec import ModelSpec
from protocol.precision import tolerances_from_checks
from protocol.rollout import RunSpec, SampleRollout, TaskRollouts
from protocol.seeds import env_seed, sampling_seed, task_seed

logger = logging.getLogger(__name__)

_MANIFEST = b"\x00" * 31 + b"\x01"  # not checked here: pre-flight measures the computation only
_CHAIN_ID, _POOL = 0, "0x" + "00" * 20  # a preflight is no pool's work: any fixed venue gives real seeds
CONTEXT_TASKS = 512
"""Tasks whose prompts are rendered to find the longest one the engine's context must hold."""


@dataclass(frozen=True)
class Check:
    """One measurement: the worst value seen, the limit it must not exceed, and the room left."""

    name: str
    worst: float
    limit: float

    @property
    def margin(self) -> float:
        return self.limit - self.worst

    @property
    def ok(self) -> bool:
        return self.worst <= self.limit


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Failures that are not a number against a limit (termination, a malformed rollout)."""
    samples: int = 0
    tokens: int = 0
    generation_s: float = 0.0
    check_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.checks)

    def lines(self) -> list[str]:
        out = [f"pre-flight: {self.samples} samples, {self.tokens} tokens generated in {self.generation_s:.1f} s "
               f"({self.tokens / max(self.generation_s, 1e-9):.1f} tok/s), checked in {self.check_s:.1f} s",
               f"  {'measurement':<28} {'worst':>10} {'limit':>10} {'margin':>10}"]
        for c in self.checks:
            out.append(f"  {c.name:<28} {_num(c.worst):>10} {_num(c.limit):>10} {_num(c.margin):>10}"
                       f"  {'ok' if c.ok else 'WOULD BE REJECTED'}")
        out += [f"  problem: {p}" for p in self.problems]
        out.append("pre-flight passed: honest work from this machine passes the validator's checks" if self.ok else
                   "pre-flight FAILED: work from this machine would be rejected (and slashed)")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "samples": self.samples, "tokens": self.tokens,
                "generation_s": round(self.generation_s, 3), "check_s": round(self.check_s, 3),
                "checks": [{"name": c.name, "worst": c.worst, "limit": c.limit, "margin": c.margin, "ok": c.ok}
                           for c in self.checks], "problems": self.problems}


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def run_preflight(engine: InferenceEngine, model: ModelSpec, run: RunSpec, checks: dict[str, Any], *,
                  batches: int, dtype: str = "float32") -> PreflightReport:
    """Generate `batches` assignments with `engine` and measure them as a validator with `checks` would."""
    from models.loading import load
    from models.sampling import SamplingParams
    from toploc.thresholds import ToplocThresholds
    from toploc.validation import Rollout, measure

    # the tolerances of the precision this engine computes in, the one its submissions declare
    precision = engine.precision
    tolerance = tolerances_from_checks(checks, precision).sampling_margin
    thresholds = ToplocThresholds(**{**{k: checks[k] for k in ToplocThresholds.model_fields if k in checks},
                                     "sampling_margin_tolerance": tolerance})
    logprob_tolerance = float(checks.get("logprob_tolerance", 0.5))
    reward_tolerance = float(checks.get("reward_tolerance", 1e-6))
    node = Identity.create().address  # seeds only: nothing is signed
    env = get_environment(run.env, run.env_version)
    report = PreflightReport()
    limit = engine.context_limit
    if limit is not None:
        context = context_check(engine, env, run, limit)
        if not context.ok:  # the engine refuses such a batch: nothing to generate or measure
            report.checks = [context]
            report.problems.append(f"a prompt of {int(context.worst) - run.max_new_tokens} tokens + max_new_tokens "
                                   f"{run.max_new_tokens} does not fit the engine's context of {limit}: raise "
                                   f"`engine.max_model_len` (vLLM)")
            return report
    started = time.monotonic()
    # A multi-turn run's episodes are measured on their first turns (a completion of the prompt from sampler
    # step 0, the single-turn shape); their rewards are replayed over every turn.
    subs: list[AnySubmission] = [
        (build_episode_submission if isinstance(env, MultiTurnEnvironment) else build_submission)(
            engine, run, node, 1, counter, _MANIFEST, chain_id=_CHAIN_ID, pool=_POOL) for counter in range(batches)]
    report.generation_s = time.monotonic() - started
    started = time.monotonic()
    reference = load(model, dtype=dtype)  # the validator's prefill: the run's model in its dtype
    rollouts: list[Rollout] = []
    claimed: list[SampleRollout | TurnRollout] = []
    reward_errors: list[float] = []
    for sub in subs:
        tasks = env.sample(task_seed(node, 1, sub.counter, run_id=run.run_id, chain_id=_CHAIN_ID, pool=_POOL,
                                     manifest_hash=_MANIFEST),
                           run.tasks_per_batch)
        groups: tuple[TaskRollouts | TaskEpisodes, ...] = sub.tasks
        for task, group in zip(tasks, groups, strict=True):
            prompt = prompt_ids(reference.tokenizer, task)
            for i, s in enumerate(group.samples):
                seed = sampling_seed(node, 1, task.task_id, i, run_id=run.run_id, chain_id=_CHAIN_ID, pool=_POOL,
                                     counter=sub.counter, manifest_hash=_MANIFEST)
                if isinstance(s, EpisodeRollout) and isinstance(env, MultiTurnEnvironment):
                    first = s.turns[0]
                    texts = [str(reference.tokenizer.decode(list(t.tokens), skip_special_tokens=True)) for t in s.turns]
                    e_seed = env_seed(node, 1, task.task_id, run_id=run.run_id, chain_id=_CHAIN_ID, pool=_POOL,
                                      counter=sub.counter, manifest_hash=_MANIFEST)
                    rollouts.append(Rollout(prompt, list(first.tokens), list(first.proofs), seed, run.max_new_tokens))
                    claimed.append(first)
                    reward_errors.append(abs(s.reward - env.episode_reward(task, e_seed, texts)))
                    continue
                assert isinstance(s, SampleRollout)
                rollouts.append(Rollout(prompt, list(s.tokens), list(s.proofs), seed, run.max_new_tokens))
                claimed.append(s)
                text = str(reference.tokenizer.decode(list(s.tokens), skip_special_tokens=True))
                reward_errors.append(abs(s.reward - env.reward(task, text, completion_tokens=len(s.tokens))))
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    reports = measure(reference, rollouts, params, thresholds)
    report.check_s = time.monotonic() - started
    report.samples, report.tokens = len(rollouts), sum(len(r.tokens) for r in rollouts)
    worst = {"exp": 0.0, "mean": 0.0, "median": 0.0, "sampling": 0.0, "mismatches": 0.0, "logprob": 0.0}
    for n, (rep, s) in enumerate(zip(reports, claimed, strict=True)):
        if rep.error is not None or rep.sampling is None or rep.termination is None:
            report.problems.append(f"sample {n}: {rep.error}")
            continue
        for p in rep.proofs:
            worst["exp"] = max(worst["exp"], p.exp_mismatches)
            worst["mean"] = max(worst["mean"], p.mant_err_mean)
            worst["median"] = max(worst["median"], p.mant_err_median)
        worst["sampling"] = max(worst["sampling"], max(rep.sampling.margins, default=0.0))
        worst["mismatches"] = max(worst["mismatches"], len(rep.sampling.mismatch_positions))
        worst["logprob"] = max(worst["logprob"], max((abs(a - b) for a, b in zip(s.logprobs, rep.logprobs,
                                                                                   strict=True)), default=0.0))
        if rep.termination.violations:
            report.problems.append(f"sample {n}: termination {', '.join(rep.termination.violations)}")
    report.checks = [
        Check("toploc exponent mismatches", worst["exp"], thresholds.max_exp_mismatches),
        Check("toploc mantissa error mean", worst["mean"], thresholds.max_mant_err_mean),
        Check("toploc mantissa error median", worst["median"], thresholds.max_mant_err_median),
        Check("sampling mismatches", worst["mismatches"], thresholds.max_sampling_mismatches),
        Check("logprob error", worst["logprob"], logprob_tolerance),
        Check("reward error", max(reward_errors, default=0.0), reward_tolerance),
    ]
    if limit is not None:
        report.checks.insert(0, context)
    if thresholds.max_sampling_mismatches == 0:  # then one position past the tolerance already fails
        report.checks.insert(3, Check(f"sampling margin ({precision})", worst["sampling"],
                                      thresholds.sampling_margin_tolerance))
    return report


def context_check(engine: InferenceEngine, env: Any, run: RunSpec, limit: int, tasks: int = CONTEXT_TASKS) -> Check:
    """The longest prompt of `tasks` tasks drawn from the run's environment, plus `max_new_tokens`, against the
    engine's context: a vLLM `max_model_len` below it would cut honest completions short (a hard verdict)."""
    longest, seed = 0, 0
    while tasks > 0:
        batch = env.sample(seed, min(tasks, run.tasks_per_batch))
        longest = max([longest, *(len(prompt_ids(engine.tokenizer, task)) for task in batch)])
        tasks, seed = tasks - len(batch), seed + 1
    return Check("longest prompt + max_new_tokens", longest + run.max_new_tokens, limit)
