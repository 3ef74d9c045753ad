"""Cheating multi-turn nodes, for the attack bench (`bench.attacks`) and the tests that check each cheat is caught.

Honest episodes are built by `prime-node`'s own `node.episodes.build_episode_submission`. A cheat plays the
assignment with the copy of its loop below (tasks from `task_seed`, each task's environment from `env_seed`,
one sampler stream per sample across turns, proofs per turn), one episode at a time, and deviates in one named
way in one episode (`Cheat.at`: task and sample); every other episode of the submission is honest. What each
cheat changes, and the verdict that names it (docs/protocol/wire-format.md, "Multi-turn episodes"):

| cheat | what the node does | verdict |
|---|---|---|
| `fake_env` | replaces the environment's first reply by its own (a faked tool output) | `env_mismatch` |
| `hint` | appends a hint to the environment's first reply, plays turn 2 after it | `env_mismatch` |
| `redraw` | draws the first turn again from another seed (a re-roll of a bad turn) | `sampling_mismatch` |
| `early_stop` | stops after the first turn, before the environment ended the episode | `env_mismatch` |
| `after_done` | plays one more turn after the environment said done | `env_mismatch` |
| `skip_eos` | replaces the first turn's EOS, won narrowly but beyond the drift, and goes on | `termination` |
| `inflate_reward` | claims a reward the transcript does not give | `reward_mismatch` |
| `env_seed` | plays each task's environment from a seed of its choosing (not the work key's) | `env_mismatch` |
| `two_policies` | generates the second turn with other weights (the next policy version) | proof / sampling |
| `oversize` | a first turn longer than the run's per-turn limit | `schema` |
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.adversaries import EOS_SKIP_TOLERANCE, _eos_gap, _true_logprobs, prefill_hidden, skip_narrow_eos
from environments import ChatRenderer, Message, Task
from models.engine import Engine
from models.loading import LoadedModel
from models.sampling import SamplingParams
from node.episodes import multi_turn_environment
from node.rollouts import prompt_ids
from protocol.episodes import (
    EpisodeRollout,
    EpisodeSubmission,
    TaskEpisodes,
    TurnRollout,
    environment_digest,
    episode_ending,
)
from protocol.rollout import RunSpec
from protocol.seeds import env_seed, sampling_seed, task_seed
from toploc.validation import prove

CHEATS = {
    "fake_env": "env_mismatch", "hint": "env_mismatch", "redraw": "sampling_mismatch",
    "early_stop": "env_mismatch", "after_done": "env_mismatch", "skip_eos": "termination",
    "inflate_reward": "reward_mismatch", "env_seed": "env_mismatch", "two_policies": "proof_mismatch",
    "oversize": "schema",
}
"""Each cheat and the reason code of the verdict that names it (`two_policies`: sampling_mismatch as well)."""

HINT = "Hint: reply with the names in alphabetical order, one per line, inside <names></names>."
FAKED = "Now add this name: Aaron. Reply with the whole list, sorted."


@dataclass(frozen=True)
class Assignment:
    """Who plays which assignment where (what every seed of it mixes)."""

    node: str
    version: int
    counter: int
    manifest_hash: bytes
    chain_id: int
    pool: str

    def seeds(self, run: RunSpec, task: Task, sample: int) -> tuple[int, int]:
        """(env_seed, sampling_seed) of `task`'s sample `sample`."""
        at = {"run_id": run.run_id, "chain_id": self.chain_id, "pool": self.pool, "counter": self.counter,
              "manifest_hash": self.manifest_hash}
        return (env_seed(self.node, self.version, task.task_id, **at),  # type: ignore[arg-type]
                sampling_seed(self.node, self.version, task.task_id, sample, **at))  # type: ignore[arg-type]

    def tasks(self, run: RunSpec) -> list[Task]:
        env = multi_turn_environment(run.env, run.env_version)
        return env.sample(task_seed(self.node, self.version, self.counter, run_id=run.run_id, chain_id=self.chain_id,
                                    pool=self.pool, manifest_hash=self.manifest_hash), run.tasks_per_batch)


@dataclass(frozen=True)
class Cheat:
    """One named deviation (`CHEATS`) in episode `at` = (task, sample); `other` is the `two_policies` model,
    `env_seed` the seed an `env_seed` cheat plays from (None: the first that changes what the environment says)."""

    name: str
    at: tuple[int, int] = (0, 0)
    other: LoadedModel | None = None
    env_seed: int | None = None


def _turn(loaded: LoadedModel, ids: list[int], seed: int, steps: int, params: SamplingParams, max_tokens: int
          ) -> TurnRollout:
    g = Engine(loaded).generate([ids], params, [seed], max_tokens, [steps])[0]
    return TurnRollout(tokens=tuple(g.tokens), logprobs=tuple(g.logprobs), finish_reason=g.finish_reason,
                       proofs=tuple(prove(g.hidden_states)))


def _skipped_eos_turn(loaded: LoadedModel, ids: list[int], seed: int, params: SamplingParams, max_tokens: int
                      ) -> TurnRollout:
    """A first turn (sampler step 0) whose narrowly winning EOS draws were replaced, proved and scored honestly."""
    tokens = skip_narrow_eos(loaded, ids, seed, params, max_tokens, EOS_SKIP_TOLERANCE)
    hidden = prefill_hidden(loaded, ids, tokens)
    logprobs = _true_logprobs(loaded, ids, tokens, hidden, seed, max_tokens, params)
    finish = "eos" if tokens[-1] in loaded.eos_token_ids else "length"
    return TurnRollout(tokens=tuple(tokens), logprobs=tuple(logprobs), finish_reason=finish, proofs=tuple(prove(hidden)))


def _oversize_turn(loaded: LoadedModel, ids: list[int], seed: int, params: SamplingParams, length: int
                   ) -> TurnRollout:
    """A first turn (sampler step 0) of exactly `length` tokens whatever the draws: the sampled ones without their
    EOS, then the first non-EOS token of the context repeated (a sampled turn may end early, under the limit);
    proved and scored honestly."""
    eos = set(loaded.eos_token_ids)
    g = Engine(loaded).generate([ids], params, [seed], length, [0])[0]
    tokens = [t for t in g.tokens if t not in eos]
    filler = next(t for t in [*tokens, *ids] if t not in eos)
    tokens += [filler] * (length - len(tokens))
    hidden = prefill_hidden(loaded, ids, tokens)
    logprobs = _true_logprobs(loaded, ids, tokens, hidden, seed, length, params)
    return TurnRollout(tokens=tuple(tokens), logprobs=tuple(logprobs), finish_reason="length",
                       proofs=tuple(prove(hidden)))


def other_env_seed(run: RunSpec, task: Task, true_seed: int, turn_text: str) -> int:
    """The first seed after `true_seed` under which the environment, answered `turn_text` every turn, says
    something else (what a node grinding the environment's randomness would pick); `LookupError` if none of 64
    does (the task's environment does not depend on its seed)."""
    env = multi_turn_environment(run.env, run.env_version)

    def says(seed: int) -> list[object]:
        state, said = env.start(task, seed), list[object]()
        while not state.done:
            reply = env.step(task, state, turn_text)
            state = reply.state
            said.append(reply.messages)
        return said

    truth = says(true_seed)
    for seed in range(true_seed + 1, true_seed + 65):
        if says(seed) != truth:
            return seed
    raise LookupError(f"{run.env}: task {task.task_id}'s environment does not depend on its seed")


def play(loaded: LoadedModel, renderer: ChatRenderer, run: RunSpec, at: Assignment, cheat: Cheat
         ) -> EpisodeSubmission:
    """The assignment's `EpisodeSubmission` with `cheat` applied (see the module docstring)."""
    env = multi_turn_environment(run.env, run.env_version)
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    tok = loaded.tokenizer
    groups = []
    ground = 0  # episodes an `env_seed` cheat played from a seed of its own
    for t, task in enumerate(at.tasks(run)):
        samples = []
        for i in range(run.samples_per_task):
            e_seed, seed = at.seeds(run, task, i)
            # a node grinding the environment's randomness does it in every task where the seed matters
            mine = (t, i) == cheat.at or (cheat.name == "env_seed" and i == cheat.at[1])
            name = cheat.name if mine else None
            ids = prompt_ids(tok, task)
            if name == "env_seed":
                if cheat.env_seed is not None:
                    e_seed = cheat.env_seed
                else:
                    first = _turn(loaded, list(ids), seed, 0, params, run.max_new_tokens)
                    try:
                        e_seed = other_env_seed(run, task, e_seed, renderer.decode(first.tokens))
                    except LookupError:  # this task's environment ignores its seed: nothing to grind
                        name = None
                ground += name is not None
            state = env.start(task, e_seed)
            turns: list[TurnRollout] = []
            spans: list[list[int]] = []
            steps = 0
            extra = 1 if name == "after_done" else 0
            while (not state.done or extra) and len(ids) + run.max_new_tokens <= loaded.max_context:
                k = len(turns)
                if name == "skip_eos" and k == 0:
                    turn = _skipped_eos_turn(loaded, ids, seed, params, run.max_new_tokens)
                elif name == "oversize" and k == 0:
                    turn = _oversize_turn(loaded, ids, seed, params, run.max_new_tokens + 8)
                else:
                    model = cheat.other if name == "two_policies" and k == 1 and cheat.other is not None else loaded
                    redrawn = seed + 1 if name == "redraw" and k == 0 else seed
                    turn = _turn(model, ids, redrawn, steps, params, run.max_new_tokens)
                turns.append(turn)
                ids += turn.tokens
                steps += len(turn.tokens)
                if state.done:  # the `after_done` turn: nothing answers it
                    extra = 0
                    continue
                reply = env.step(task, state, renderer.decode(turn.tokens))
                state = reply.state
                if name == "early_stop" and k == 0 and not state.done:
                    break
                messages = list(reply.messages)
                if messages and k == 0 and name == "fake_env":
                    messages = [Message(role="user", content=FAKED)]
                if messages and k == 0 and name == "hint":
                    messages.append(Message(role="user", content=HINT))
                if messages:
                    span = renderer.env_span(ids, messages)
                    spans.append(span)
                    ids += span
            ended = episode_ending(state.done, len(turns) - (1 if name == "after_done" else 0), env.max_turns)
            reward = env.score_state(task, state)
            if name == "inflate_reward":
                reward = reward + 0.5 if reward <= 0.5 else reward - 0.5
            samples.append(EpisodeRollout(turns=tuple(turns), env_digest=environment_digest(spans), ended=ended,
                                          reward=reward))
        groups.append(TaskEpisodes(task_id=task.task_id, samples=tuple(samples)))
    if cheat.name == "env_seed" and not ground:
        raise LookupError(f"no task of assignment #{at.counter} has an environment that depends on its seed")
    return EpisodeSubmission(run_id=run.run_id, node=at.node, policy_version=at.version,
                             manifest_hash=at.manifest_hash, counter=at.counter, env=run.env,
                             env_version=run.env_version, tasks=tuple(groups))


def narrow_first_eos(loaded: LoadedModel, run: RunSpec, candidates: list[Assignment], above: float,
                     batch: int = 256) -> tuple[Assignment, tuple[int, int]]:
    """The first candidate assignment, and its episode (task, sample), whose honest first turn ends early with an
    EOS that won the seeded draw by more than `above` and at most `EOS_SKIP_TOLERANCE` (the EOS a `skip_eos`
    node replaces: mid-episode, since the environment answers it). Only first turns are drawn, `batch`
    episodes per engine call (a narrow EOS is rare on the tiny model: expect tens to hundreds of candidates)."""
    params = SamplingParams(temperature=run.temperature, top_k=run.top_k, top_p=run.top_p)
    eos = set(loaded.eos_token_ids)
    rows: list[tuple[Assignment, int, int, list[int], int]] = []

    def scan() -> tuple[Assignment, tuple[int, int]] | None:
        gens = Engine(loaded).generate([r[3] for r in rows], params, [r[4] for r in rows], run.max_new_tokens)
        for (at, t, i, ids, seed), g in zip(rows, gens, strict=True):
            # an EOS at the last allowed position would be replaced by one token and no more: leave room to go on
            if g.tokens[-1] in eos and len(g.tokens) < run.max_new_tokens \
                    and above < _eos_gap(loaded, ids, g.tokens[:-1], seed, params)[0] <= EOS_SKIP_TOLERANCE:
                return at, (t, i)
        rows.clear()
        return None

    for n, at in enumerate(candidates):
        for t, task in enumerate(at.tasks(run)):
            ids = prompt_ids(loaded.tokenizer, task)
            rows += [(at, t, i, ids, at.seeds(run, task, i)[1]) for i in range(run.samples_per_task)]
        if len(rows) >= batch or n == len(candidates) - 1:
            found = scan()
            if found is not None:
                return found
    raise LookupError(f"no narrow EOS in the first turns of {len(candidates)} assignments")
