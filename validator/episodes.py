"""The multi-turn check: a node's episodes replayed turn by turn, then measured at model positions only.

For each episode (`protocol.episodes.EpisodeRollout`), cheapest first:

1. the environment replayed on the node's own turns (`environments.render_episode`: each turn decoded as the
   node decodes it, the environment's reply rendered to tokens by the chat template): a turn after the
   environment said done, an environment digest the replay does not reproduce, or an ending it does not
   reach is `env_mismatch`. An episode may end `max_tokens` only where its next turn could not fit the
   model's context (the rule the node's loop applies);
2. the reward recomputed from the replayed transcript (`reward_mismatch`);
3. the model: one prefill over each episode's whole rebuilt sequence (`turn_states`), its rows cut per model
   turn and measured there only (`toploc.validation.measure`): the sampler replayed from the step after the
   previous turn's last token, TOPLOC proofs per turn, termination per turn against `run.max_new_tokens`,
   judged by the single-turn rules (`validator.judge`).

Accepted episodes become `EpisodeFeedGroup`s: the rebuilt sequence, its model spans and the replayed logprobs.
Paid units count model tokens only (each turn up to the replay's first EOS). A failure of the environment's
own code (`UngradableError`) propagates: the caller treats it as ours, never the node's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from environments import ChatRenderer, MultiTurnEnvironment, Task, render_episode
from environments import get as get_environment
from protocol.episodes import (
    EpisodeFeedGroup,
    EpisodeFeedItem,
    EpisodeFeedSample,
    EpisodeSubmission,
    environment_digest,
    episode_ending,
)
from protocol.errors import TaskEnvironmentError
from protocol.rollout import Reason, RunSpec, SampleRollout
from validator.judge import (
    PRECEDENCE,
    PROOF_BYTES,
    Failure,
    SampleMeasurement,
    measure_sample,
    paid_tokens,
    sample_failures,
)

if TYPE_CHECKING:
    import torch

    from environments.renderer import RenderedEpisode
    from models.loading import LoadedModel
    from toploc.thresholds import ToplocThresholds

ORDER = (Reason.SCHEMA, Reason.ENV_MISMATCH, Reason.REWARD_MISMATCH, *PRECEDENCE)
"""When an episode submission fails several checks, the verdict names the first of these."""


@dataclass(frozen=True)
class EpisodeCheck:
    """The first failure (None: accepted), what was recomputed and measured, and the feed when accepted."""

    failure: Failure | None
    rewards: list[list[float]]
    """Recomputed rewards per task and sample (empty where the replay stopped before them)."""
    turns: tuple[tuple[SampleMeasurement, ...], ...] = ()
    """Per episode, in order, one measurement per turn (empty when the model stage did not run)."""
    paid_tokens: int | None = None
    """Model tokens paid for (None when not measured)."""
    groups: tuple[EpisodeFeedGroup, ...] = ()
    """The trainer's view of the accepted submission (empty unless accepted)."""


def episode_schema_problem(sub: EpisodeSubmission, run: RunSpec, proof_block: int) -> str | None:
    """The first way `sub` breaks the run's shape and limits (samples, turns, per-turn lengths and proofs,
    numbers), or None: `validator.intake`'s cheap check for version 2 (per turn what version 1 checks per sample)."""
    for t, task in enumerate(sub.tasks):
        if len(task.samples) != run.samples_per_task:
            return f"task {t} has {len(task.samples)} samples, the run asks {run.samples_per_task}"
        for i, s in enumerate(task.samples):
            if not math.isfinite(s.reward):
                return f"task {t} sample {i}: reward not finite"
            for k, turn in enumerate(s.turns):
                where = f"task {t} sample {i} turn {k}"
                if len(turn.tokens) > run.max_new_tokens:
                    return f"{where}: {len(turn.tokens)} tokens > max_new_tokens {run.max_new_tokens}"
                if turn.finish_reason == "length" and len(turn.tokens) != run.max_new_tokens:
                    return f"{where}: finish_reason length with {len(turn.tokens)} of {run.max_new_tokens} tokens"
                if (len(turn.proofs) != -(-len(turn.tokens) // proof_block)
                        or any(len(p) != PROOF_BYTES for p in turn.proofs)):
                    return f"{where}: {len(turn.proofs)} proofs for {len(turn.tokens)} tokens"
                if not all(math.isfinite(x) and x <= 0.0 for x in turn.logprobs):
                    return f"{where}: logprobs must be finite and <= 0"
    return None


def replay_problem(rendered: RenderedEpisode, sample_digest: bytes, ended: str, env: MultiTurnEnvironment,
                   run: RunSpec, max_context: int) -> str | None:
    """Why an episode's commitment (digest, ending) is not what the replay of its environment gives, or None."""
    spans = [rendered.ids[o:o + n] for o, n in rendered.env_spans]
    if environment_digest(spans) != sample_digest:
        return "the environment digest is not the replay's (an environment span the environment did not say)"
    replayed = episode_ending(rendered.episode.done, len(rendered.model_spans), env.max_turns)
    if replayed == "max_tokens" and len(rendered.ids) + run.max_new_tokens <= max_context:
        return f"the episode stopped after {len(rendered.model_spans)} turns, before the environment ended it"
    if replayed != ended:
        return f"ended {ended!r}, the replay ends {replayed!r}"
    return None


def turn_states(loaded: LoadedModel, rendered: Sequence[RenderedEpisode], batch_tokens: int) -> list[torch.Tensor]:
    """One prefill per episode over its whole interleaved sequence (a task's prompt shared by its samples,
    `models.scoring.Scorer`), cut into the rows that produced each model turn, episode after episode."""
    from models.scoring import Scorer

    prompts: dict[tuple[int, ...], int] = {}
    index = [prompts.setdefault(tuple(r.ids[:r.prompt_len]), len(prompts)) for r in rendered]
    states = Scorer.of(loaded).hidden([list(p) for p in prompts], [list(r.ids[r.prompt_len:]) for r in rendered],
                                      index, batch_tokens=batch_tokens)
    out = []
    for r, h in zip(rendered, states, strict=True):
        # row k of `h` produced the k-th id after the prompt: a span at `offset` starts at row offset - prompt_len
        out += [h[offset - r.prompt_len:offset - r.prompt_len + n] for offset, n in r.model_spans]
    return out


def check_episodes(loaded: LoadedModel, renderer: ChatRenderer, sub: EpisodeSubmission, tasks: Sequence[Task], *,
                   env_seeds: Sequence[int], seeds: Sequence[Sequence[int]], run: RunSpec,
                   thresholds: ToplocThresholds, reward_tolerance: float, logprob_tolerance: float,
                   eos_tie_drift: float, batch_tokens: int = 8192) -> EpisodeCheck:
    """Check `sub` (see the module docstring). `env_seeds[t]`: task t's `protocol.seeds.env_seed`; `seeds[t][i]`:
    sample i's `sampling_seed`. The assignment, version window and schema limits are checked before this."""
    from models.sampling import SamplingParams
    from toploc.validation import Rollout, measure

    env = get_environment(sub.env, sub.env_version)
    if not isinstance(env, MultiTurnEnvironment):
        return EpisodeCheck((Reason.SCHEMA, f"{sub.env}@{sub.env_version} is not a multi-turn environment"), [])
    rendered: list[RenderedEpisode] = []
    rewards: list[list[float]] = []
    failures: dict[Reason, str] = {}
    for t, (task, tr) in enumerate(zip(tasks, sub.tasks, strict=True)):
        rewards.append([])
        for i, sample in enumerate(tr.samples):
            where = f"task {t} sample {i}"
            if any(tok >= loaded.vocab_size for turn in sample.turns for tok in turn.tokens):
                failures.setdefault(Reason.SCHEMA, f"{where}: token ids outside the vocabulary")
                continue
            try:
                r = render_episode(renderer, env, task, env_seeds[t], [turn.tokens for turn in sample.turns])
            except TaskEnvironmentError as exc:  # a turn after the end (UngradableError, ours, propagates)
                failures.setdefault(Reason.ENV_MISMATCH, f"{where}: {exc}")
                continue
            problem = replay_problem(r, bytes(sample.env_digest), sample.ended, env, run, loaded.max_context)
            if problem is not None:
                failures.setdefault(Reason.ENV_MISMATCH, f"{where}: {problem}")
            if len(r.ids) - 1 > loaded.max_context:
                failures.setdefault(Reason.SCHEMA, f"{where}: {len(r.ids)} tokens, longer than the model's context")
            rewards[-1].append(r.episode.reward)
            if abs(sample.reward - r.episode.reward) > reward_tolerance:
                failures.setdefault(Reason.REWARD_MISMATCH, f"{where}: claimed reward {sample.reward}, "
                                                            f"recomputed {r.episode.reward}")
            rendered.append(r)
    if failures:
        return EpisodeCheck(next((r, failures[r]) for r in ORDER if r in failures), rewards)

    rollouts: list[Rollout] = []
    claimed: list[SampleRollout] = []
    samples = [s for tr in sub.tasks for s in tr.samples]
    flat_seeds = [seed for per_task in seeds for seed in per_task]
    for r, sample, seed in zip(rendered, samples, flat_seeds, strict=True):
        steps = 0
        for (offset, _), turn in zip(r.model_spans, sample.turns, strict=True):
            rollouts.append(Rollout(r.ids[:offset], list(turn.tokens), list(turn.proofs), seed, run.max_new_tokens,
                                    step_offset=steps))
            claimed.append(SampleRollout(tokens=turn.tokens, logprobs=turn.logprobs,
                                         finish_reason=turn.finish_reason, reward=0.0, proofs=turn.proofs))
            steps += len(turn.tokens)
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    reports = measure(loaded, rollouts, params, thresholds, batch_tokens=batch_tokens,
                      hidden_states=turn_states(loaded, rendered, batch_tokens))
    per_turn: list[SampleMeasurement] = []
    for j, (rep, c) in enumerate(zip(reports, claimed, strict=True)):
        m = measure_sample(rep, c, thresholds, eos_tie_drift)
        per_turn.append(m)
        for reason, detail in sample_failures(j, m, rep, c, thresholds, logprob_tolerance, eos_tie_drift).items():
            failures.setdefault(reason, f"turn {detail}")
    turns: list[tuple[SampleMeasurement, ...]] = []
    at = 0
    for sample in samples:
        turns.append(tuple(per_turn[at:at + len(sample.turns)]))
        at += len(sample.turns)
    paid = paid_tokens(per_turn)
    if failures:
        return EpisodeCheck(next((r, failures[r]) for r in ORDER if r in failures), rewards, tuple(turns), paid)

    groups: list[EpisodeFeedGroup] = []
    at = 0
    k = 0
    for tr in sub.tasks:
        feed: list[EpisodeFeedSample] = []
        for _ in tr.samples:
            r = rendered[k]
            k += 1
            logprobs: list[float] = []
            for _ in r.model_spans:
                logprobs += reports[at].logprobs
                at += 1
            feed.append(EpisodeFeedSample(
                tokens=r.ids[r.prompt_len:], spans=tuple((o - r.prompt_len, n) for o, n in r.model_spans),
                logprobs=tuple(logprobs), reward=r.episode.reward))
        groups.append(EpisodeFeedGroup(task_id=tr.task_id, prompt_tokens=rendered[k - 1].ids[:rendered[k - 1].prompt_len],
                                       samples=tuple(feed)))
    return EpisodeCheck(None, rewards, tuple(turns), paid, tuple(groups))


def episode_feed_item(work_key: bytes, sub: EpisodeSubmission, check: EpisodeCheck) -> EpisodeFeedItem:
    """The trainer's feed item of accepted (or, on appeal, restored) episodes: `check`'s rebuilt groups."""
    if check.failure is not None or not check.groups:
        raise ValueError("only an accepted episode check has a feed item")
    return EpisodeFeedItem(run_id=sub.run_id, work_key=work_key, node=sub.node, policy_version=sub.policy_version,
                           env=sub.env, env_version=sub.env_version, groups=check.groups)
