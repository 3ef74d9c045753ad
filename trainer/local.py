"""Local mode: the trainer samples its own rollouts with the `models/` engine, no network involved.

Step n draws `groups_per_step` tasks from the environment (seeded by `task_seed` and n), samples
`group_size` completions per task with the current policy (so policy_version = n, staleness 0),
grades them with the environment's reward, and hands the groups to the trainer. Every seed is a
function of (task_seed, n, index), so a resumed run regenerates exactly the same rollouts. A group
with a sample the environment could not grade (`UngradableError`: a starved math worker, a sandbox
that would not start) is dropped, logged and counted (`WindowCounts.ungradable`), never trained on
as reward 0: the step goes on with the other groups.
Single process only (generation needs the whole model; use the directory source under torchrun).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from environments import Environment, UngradableError, render_prompt
from models import LoadedModel
from models.engine import Engine
from models.sampling import SamplingParams
from protocol.rollout_files import Sample
from trainer.source import Batch, RolloutSource, WindowCounts

log = logging.getLogger(__name__)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from its parts (stable across runs, machines and Python versions)."""
    h = hashlib.blake2b("\x00".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


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

    def attach(self, model: torch.nn.Module) -> None:
        """Generate with `model` (the trainer's live policy) from now on."""
        self.policy = model

    def next_batch(self, step: int, n_groups: int, async_level: int, *, min_groups: int | None = None,
                   fill_timeout_s: float | None = None, expected: int | None = None) -> Batch:  # never waits
        t0 = time.monotonic()
        tok = self.loaded.tokenizer
        tasks = self.env.sample(derive_seed("tasks", self.task_seed, step) % (2**63), n_groups)
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
            # A fresh engine per step: its fast path copies (fused) weights, which change every step.
            view = LoadedModel(self.policy, tok, self.loaded.spec, self.loaded.eos_token_ids,  # type: ignore[arg-type]
                               self.loaded.max_context)
            gens = Engine(view).generate(prompts, self.params, seeds, self.max_new_tokens)
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

    def state_dict(self) -> dict[str, Any]:
        # Everything is a function of (task_seed, step) and the weights, which the checkpoint holds.
        return {"task_seed": self.task_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task_seed = int(state["task_seed"])
