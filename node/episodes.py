"""One multi-turn assignment, start to finish: every sample's episode played turn by turn, proven per turn.

The multi-turn counterpart of `node.rollouts.build_submission`: tasks from `task_seed`, each sample's sampler
stream from `sampling_seed` (one stream across all its turns: a turn's first token takes the step after the
previous turn's last), each task's environment from `env_seed`. Turn k of every live episode of the
assignment is generated in one engine batch, then the environment answers each; the engine's weights are
not swapped while an assignment runs (the worker holds its runtime lock per submission), so every turn is
the same policy version's. The validator replays all of it (docs/protocol/wire-format.md, "Multi-turn
episodes"); any difference is a hard verdict, so this follows `protocol/episodes.py` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from environments import ChatRenderer, MultiTurnEnvironment, Task
from environments import get as get_environment
from environments.episode import EpisodeState
from node.inference import InferenceEngine, Request
from node.rollouts import prompt_ids
from protocol.episodes import (
    EpisodeRollout,
    EpisodeSubmission,
    TaskEpisodes,
    TurnRollout,
    environment_digest,
    episode_ending,
)
from protocol.errors import ModelError, TaskEnvironmentError
from protocol.rollout import RunSpec
from protocol.seeds import env_seed, sampling_seed, task_seed


@dataclass
class _Playing:
    """One sample's episode while it is being played."""

    task: Task
    seed: int
    state: EpisodeState
    ids: list[int]
    turns: list[TurnRollout] = field(default_factory=list)
    env_spans: list[list[int]] = field(default_factory=list)
    steps: int = 0
    """Model tokens so far: the sampler step of the next turn's first token."""
    out_of_context: bool = False


def multi_turn_environment(name: str, version: str) -> MultiTurnEnvironment:
    env = get_environment(name, version)
    if not isinstance(env, MultiTurnEnvironment):
        raise TaskEnvironmentError(f"{name}@{version} is single-turn: submit version 1 (node.rollouts)")
    return env


def build_episode_submission(engine: InferenceEngine, run: RunSpec, node: str, version: int, counter: int,
                             manifest_hash: bytes, *, chain_id: int, pool: str,
                             renderer: ChatRenderer | None = None) -> EpisodeSubmission:
    """The unsigned `EpisodeSubmission` of assignment (`node`, `version`, `counter`) in `run` (a multi-turn
    environment); `run.max_new_tokens` is the per-turn limit. `renderer`: one already built for the engine's
    tokenizer (its construction runs the template's prefix check)."""
    if not engine.step_offsets:
        raise ModelError(f"{type(engine).__name__} cannot continue a sampler stream across turns")
    env = multi_turn_environment(run.env, run.env_version)
    tok = engine.tokenizer
    r = renderer if renderer is not None else ChatRenderer(tok)
    tasks = env.sample(task_seed(node, version, counter, run_id=run.run_id, chain_id=chain_id, pool=pool,
                                 manifest_hash=manifest_hash),
                       run.tasks_per_batch)
    episodes: list[_Playing] = []
    for task in tasks:
        start = env.start(task, env_seed(node, version, task.task_id, run_id=run.run_id, chain_id=chain_id,
                                         pool=pool, counter=counter, manifest_hash=manifest_hash))
        ids = prompt_ids(tok, task)
        episodes += [_Playing(task, sampling_seed(node, version, task.task_id, i, run_id=run.run_id,
                                                  chain_id=chain_id, pool=pool, counter=counter,
                                                  manifest_hash=manifest_hash), start, list(ids))
                     for i in range(run.samples_per_task)]
    limit = engine.context_limit
    if limit is not None and any(len(e.ids) + run.max_new_tokens > limit for e in episodes):
        raise ModelError(f"a prompt + max_new_tokens {run.max_new_tokens} exceeds the engine's context of {limit}")
    while True:
        live = [e for e in episodes if not e.state.done and not e.out_of_context]
        for e in live:  # a turn that cannot fit the context is never started (the validator applies this rule)
            if limit is not None and len(e.ids) + run.max_new_tokens > limit:
                e.out_of_context = True
        live = [e for e in live if not e.out_of_context]
        if not live:
            break
        done = engine.generate([Request(list(e.ids), e.seed, e.steps) for e in live], run)
        for e, c in zip(live, done, strict=True):
            e.turns.append(TurnRollout(tokens=tuple(c.tokens), logprobs=tuple(c.logprobs),
                                       finish_reason=c.finish_reason, proofs=tuple(c.proofs)))
            e.ids += c.tokens
            e.steps += len(c.tokens)
            reply = env.step(e.task, e.state, r.decode(c.tokens))
            e.state = reply.state
            if reply.messages:
                span = r.env_span(e.ids, reply.messages)
                e.env_spans.append(span)
                e.ids += span
    groups = []
    for t, task in enumerate(tasks):
        samples = []
        for e in episodes[t * run.samples_per_task:(t + 1) * run.samples_per_task]:
            samples.append(EpisodeRollout(
                turns=tuple(e.turns), env_digest=environment_digest(e.env_spans),
                ended=episode_ending(e.state.done, len(e.turns), env.max_turns),
                reward=env.score_state(task, e.state)))
        groups.append(TaskEpisodes(task_id=task.task_id, samples=tuple(samples)))
    return EpisodeSubmission(run_id=run.run_id, node=node, policy_version=version, manifest_hash=manifest_hash,
                             counter=counter, env=run.env, env_version=run.env_version,
                             precision=engine.precision, tasks=tuple(groups))
