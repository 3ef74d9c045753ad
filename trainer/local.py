"""Local mode: the trainer samples its own rollouts with the `models/` engine, no network involved.

Step n draws `groups_per_step` tasks from the environment (seeded by `task_seed` and n), samples
`group_size` completions per task with the current policy (so policy_version = n, staleness 0),
grades them with the environment's reward, and hands the groups to the trainer. Every seed is a
function of (task_seed, n, index), so a resumed run regenerates exactly the same rollouts. A group
with a sample the environment could not grade (`UngradableError`: a starved math worker, a sandbox
that would not start; for a multi-turn environment also a turn its `step` could not answer) is dropped, logged
and counted (`WindowCounts.ungradable`), never trained on as reward 0: the step goes on with the other groups.
Single process only (generation needs the whole model; use the directory source under torchrun).

A multi-turn environment (`environments.MultiTurnEnvironment`: `calc-arith`, `alphabet-sort`, `wordle`)
is played as the network plays it: each sample's episode turn by turn, turn k of every live episode of the
step in one engine batch, one sampler stream per sample across its turns (a turn's first token takes the
step after the previous turn's last), the environment's replies appended as tokens by
`environments.ChatRenderer` (the model's own ids never re-tokenized), `max_new_tokens` per turn, no turn
started that cannot fit the context. The sample is the prompt then the interleaved sequence, trained only on
the model's spans (`protocol.rollout_files.episode_sample`, the feed path's mask and its check that every
loss position holds a model token), rewarded with the episode's score: one GRPO advantage per episode.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from environments import ChatRenderer, Environment, MultiTurnEnvironment, Task, UngradableError, render_prompt
from environments.episode import EpisodeState
from models import LoadedModel
from models.engine import Engine
from models.sampling import SamplingParams
from protocol.episodes import EpisodeFeedSample
from protocol.rollout_files import RolloutError, Sample, episode_sample
from trainer.source import Batch, RolloutSource, WindowCounts

log = logging.getLogger(__name__)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from its parts (stable across runs, machines and Python versions)."""
    h = hashlib.blake2b("\x00".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


class PlayedEpisode:
    """One sample's episode while it is played (`play_episodes`)."""

    def __init__(self, task: Task, group: int, seed: int, prompt: list[int], state: EpisodeState) -> None:
        self.task, self.group, self.seed, self.state = task, group, seed, state
        self.ids = list(prompt)
        self.prompt_len = len(prompt)
        self.spans: list[tuple[int, int]] = []
        """(offset after the prompt, length) of each model turn."""
        self.logprobs: list[float] = []
        """The sampling logprobs of every model token so far (their count is the next turn's sampler step)."""
        self.generated: list[int] = []
        """Every token the model generated, in order: exactly what the loss positions must hold."""
        self.finish_reason = ""
        """How the last model turn ended (`stop`, `length`)."""
        self.ungradable: str | None = None
        """Why the environment could not answer a turn (`UngradableError`): the episode stops, its group is dropped."""


def play_episodes(engine: Engine, env: MultiTurnEnvironment, renderer: ChatRenderer, playing: list[PlayedEpisode],
                  params: SamplingParams, max_new_tokens: int, context: int) -> None:
    """Play every episode of `playing` to its end (the environment says done, a turn would not fit `context`, or
    the environment cannot answer): turn k of every live episode in one engine batch, each sample's sampler
    stream continued across its turns, the environment's replies appended as tokens without re-tokenizing the
    model's. The local mode's steps and the held-out evaluation of a multi-turn environment both play this way."""
    while True:
        live = [e for e in playing if not e.state.done and e.ungradable is None
                and len(e.ids) + max_new_tokens <= context]
        if not live:
            return
        gens = engine.generate([list(e.ids) for e in live], params, [e.seed for e in live], max_new_tokens,
                               step_offsets=[len(e.logprobs) for e in live])
        for e, gen in zip(live, gens, strict=True):
            e.spans.append((len(e.ids) - e.prompt_len, len(gen.tokens)))
            e.ids += gen.tokens
            e.logprobs += [float(x) for x in gen.logprobs]
            e.generated += gen.tokens
            e.finish_reason = gen.finish_reason
            try:
                reply = env.step(e.task, e.state, renderer.decode(gen.tokens))
            except UngradableError as exc:  # the environment's failure, not the model's: never a reward
                e.ungradable = str(exc)
                continue
            e.state = reply.state
            if reply.messages:
                e.ids += renderer.env_span(e.ids, reply.messages)


class LocalSource(RolloutSource):
    """Generates each step's groups from the live policy (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        env: Environment,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        task_seed: int = 0,
    ) -> None:
        self.loaded = loaded
        self.env = env
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.params = SamplingParams(temperature=temperature)
        self.task_seed = task_seed
        self.policy: torch.nn.Module = loaded.model
        self.last_generation_s = 0.0
        self.last_prompts: list[str] = []
        self.last_completions: list[str] = []
        self._renderer: ChatRenderer | None = None

    def attach(self, model: torch.nn.Module) -> None:
        """Generate with `model` (the trainer's live policy) from now on."""
        self.policy = model

    def _engine(self) -> Engine:
        # A fresh engine per step: its fast path copies (fused) weights, which change every step.
        view = LoadedModel(self.policy, self.loaded.tokenizer, self.loaded.spec,  # type: ignore[arg-type]
                           self.loaded.eos_token_ids, self.loaded.max_context)
        return Engine(view)

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:  # never waits
        t0 = time.monotonic()
        tok = self.loaded.tokenizer
        tasks = self.env.sample(derive_seed("tasks", self.task_seed, step) % (2**63), n_groups)
        if isinstance(self.env, MultiTurnEnvironment):
            batch = self._episodes(self.env, step, tasks)
            self.last_generation_s = time.monotonic() - t0
            return batch
        prompts: list[list[int]] = []
        seeds: list[int] = []
        for g, task in enumerate(tasks):
            ids = render_prompt(tok, task, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            for k in range(self.group_size):
                prompts.append([int(t) for t in ids])
                seeds.append(derive_seed("sample", self.task_seed, step, g, k))
        was_training = self.policy.training
        self.policy.eval()
        try:
            gens = self._engine().generate(prompts, self.params, seeds, self.max_new_tokens)
        finally:
            self.policy.train(was_training)
        groups: list[list[Sample]] = []
        ungradable = 0
        self.last_completions = []
        self.last_prompts = [str(tok.decode(p)) for p in prompts[:: self.group_size]]
        for g, task in enumerate(tasks):
            group_gens = gens[g * self.group_size : (g + 1) * self.group_size]
            texts = [str(tok.decode(gen.tokens, skip_special_tokens=True)) for gen in group_gens]
            self.last_completions.extend(texts)
            try:
                rewards = [self.env.reward(task, text, completion_tokens=len(gen.tokens))
                           for gen, text in zip(group_gens, texts, strict=True)]
            except UngradableError as exc:
                # One missing reward would skew the whole group's advantages: drop all of it.
                log.warning("step %d: group %d dropped, %s could not grade it: %s", step, g, task.env, exc)
                ungradable += self.group_size
                continue
            group = []
            for gen, reward in zip(group_gens, rewards, strict=True):
                p = gen.prompt_tokens
                group.append(Sample(
                    tokens=tuple(p) + tuple(gen.tokens),
                    loss_mask=(False,) * len(p) + (True,) * len(gen.tokens),
                    sampling_logprobs=(0.0,) * len(p) + tuple(float(x) for x in gen.logprobs),
                    reward=float(reward),
                    group_id=f"{step}-{g}",
                    policy_version=step,
                    task_id=task.task_id,
                    env_name=task.env,
                    env_version=task.env_version,
                ))
            groups.append(group)
        self.last_generation_s = time.monotonic() - t0
        n = sum(len(g) for g in groups)
        return Batch(groups=groups, counts=WindowCounts(accepted=n, ungradable=ungradable))

    def _episodes(self, env: MultiTurnEnvironment, step: int, tasks: list[Task]) -> Batch:
        """One step of a multi-turn environment (see the module docstring)."""
        if self._renderer is None:
            self._renderer = ChatRenderer(self.loaded.tokenizer)  # runs the template's prefix check once
        r = self._renderer
        playing = [PlayedEpisode(task, g, derive_seed("sample", self.task_seed, step, g, k),
                                 r.prompt_ids(task.messages), env.start(task, derive_seed("env", self.task_seed, step, g)))
                   for g, task in enumerate(tasks) for k in range(self.group_size)]
        was_training = self.policy.training
        self.policy.eval()
        try:  # one engine, so one policy, for every turn of the step
            play_episodes(self._engine(), env, r, playing, self.params, self.max_new_tokens, self.loaded.max_context)
        finally:
            self.policy.train(was_training)
        groups: list[list[Sample]] = []
        ungradable = 0
        self.last_prompts = [str(self.loaded.tokenizer.decode(e.ids[:e.prompt_len])) for e in playing[::self.group_size]]
        self.last_completions = [r.decode(e.ids[e.prompt_len:]) for e in playing]
        for g, task in enumerate(tasks):
            episodes = [e for e in playing if e.group == g]
            failed = next((e.ungradable for e in episodes if e.ungradable is not None), None)
            if failed is not None:
                log.warning("step %d: group %d dropped, %s could not answer a turn: %s", step, g, task.env, failed)
                ungradable += len(episodes)
                continue
            try:
                rewards = [env.score_state(task, e.state) for e in episodes]
            except UngradableError as exc:
                log.warning("step %d: group %d dropped, %s could not grade it: %s", step, g, task.env, exc)
                ungradable += len(episodes)
                continue
            if any(not e.spans for e in episodes):  # a prompt too long for even one turn: nothing to train on
                log.warning("step %d: group %d dropped, a prompt leaves no room for a turn in the context", step, g)
                ungradable += len(episodes)
                continue
            group = []
            for e, reward in zip(episodes, rewards, strict=True):
                sample = episode_sample(
                    e.ids[:e.prompt_len],
                    EpisodeFeedSample(tokens=tuple(e.ids[e.prompt_len:]), spans=tuple(e.spans),
                                      logprobs=tuple(e.logprobs), reward=float(reward)),
                    group_id=f"{step}-{g}", policy_version=step, task_id=task.task_id, env_name=task.env,
                    env_version=task.env_version)
                if [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m] != e.generated:
                    raise RolloutError(f"step {step}: an episode's loss positions do not hold the tokens the model "
                                       f"generated (the spans and the rendering disagree)")
                group.append(sample)
            groups.append(group)
        n = sum(len(g) for g in groups)
        return Batch(groups=groups, counts=WindowCounts(accepted=n, ungradable=ungradable))

    def state_dict(self) -> dict[str, Any]:
        # Everything is a function of (task_seed, step) and the weights, which the checkpoint holds.
        return {"task_seed": self.task_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task_seed = int(state["task_seed"])
