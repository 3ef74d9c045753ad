"""Length-controlled rewards (INTELLECT-2 / L1 style) as a wrapper around any environment.

Each task gets a target length drawn from `targets`, stated in the system prompt ("Think for about
T tokens"), and the inner reward r is adjusted by the completion's length L:

- `exact`: clamp(r - alpha * |L - T| / T): too short is penalized like too long (L1-Exact);
- `max`:   r * clamp(1 - alpha * max(0, L - T) / T): only overshoot costs (L1-Max, budget);
- `clip`:  r if L <= T else 0: a hard budget.

L is the completion's token count when the caller passes `completion_tokens=` (node and validator
both hold the tokens, so they should); otherwise ceil(len(completion) / CHARS_PER_TOKEN), a
documented, deterministic fallback that is only a rough proxy for tokens.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from protocol.errors import TaskEnvironmentError

from .base import Environment
from .task import Message, Task, make_task

LENGTH_VERSION = "1"
CHARS_PER_TOKEN = 4
LengthMode = Literal["exact", "max", "clip"]
MODES: tuple[str, ...] = ("exact", "max", "clip")


def completion_length(completion: str, completion_tokens: int | None) -> int:
    """Tokens when given, else the character fallback."""
    if completion_tokens is not None:
        if isinstance(completion_tokens, bool) or not isinstance(completion_tokens, int) or completion_tokens < 0:
            raise TaskEnvironmentError(f"completion_tokens must be a non-negative int, got {completion_tokens!r}")
        return completion_tokens
    return math.ceil(len(completion) / CHARS_PER_TOKEN)


def length_factor(mode: str, reward: float, length: int, target: int, alpha: float) -> float:
    """The adjusted reward for `mode` (see the module docstring); always in [0, 1]."""
    if mode == "exact":
        value = reward - alpha * abs(length - target) / target
    elif mode == "max":
        value = reward * (1.0 - alpha * max(0, length - target) / target)
    elif mode == "clip":
        value = reward if length <= target else 0.0
    else:
        raise TaskEnvironmentError(f"unknown length mode {mode!r}; choose one of {MODES}")
    return min(1.0, max(0.0, value))


class LengthReward(Environment):
    """`inner` with a stated target length and a length-adjusted reward."""

    def __init__(self, inner: Environment, mode: LengthMode = "max",
                 targets: tuple[int, ...] = (64, 128, 256, 512), alpha: float = 0.5) -> None:
        if mode not in MODES:
            raise TaskEnvironmentError(f"unknown length mode {mode!r}; choose one of {MODES}")
        if not targets or any(t <= 0 for t in targets) or alpha < 0:
            raise TaskEnvironmentError("length targets must be positive and alpha non-negative")
        self.inner = inner
        self.mode = mode
        self.targets = tuple(targets)
        self.alpha = alpha
        # Instance attributes shadow the ClassVars: the name and version follow the inner env.
        self.name = f"{inner.name}+length-{mode}"  # type: ignore[misc]
        self.version = f"{inner.version}.length{LENGTH_VERSION}"  # type: ignore[misc]

    def _wrap(self, inner_task: Task, target: int) -> Task:
        note = f"Think for about {target} tokens before giving your final answer."
        messages = list(inner_task.messages)
        if messages and messages[0].role == "system":
            messages[0] = Message(role="system", content=f"{messages[0].content}\n{note}")
        else:
            messages.insert(0, Message(role="system", content=note))
        info = {**inner_task.info, "target_length": target}
        return make_task(self.name, self.version, messages, inner_task.answer, inner_task.tests, info)

    def _generate(self, rng: random.Random) -> Task:
        inner_task = self.inner._generate(rng)
        return self._wrap(inner_task, rng.choice(self.targets))

    def task_from(self, question: str, answer: str, *, target_length: int | None = None) -> Task:
        """The inner environment's task, with `target_length` (default: the middle target)."""
        target = target_length or sorted(self.targets)[len(self.targets) // 2]
        if target <= 0:
            raise TaskEnvironmentError("target_length must be positive")
        return self._wrap(self.inner.task_from(question, answer), target)

    def reward(self, task: Task, completion: str, *, completion_tokens: int | None = None) -> float:
        """The inner reward adjusted for length; the inner grader's `UngradableError` passes through
        (never a length-adjusted 0)."""
        length = completion_length(completion, completion_tokens)
        return length_factor(self.mode, super().reward(task, completion), length,
                             int(task.info["target_length"]), self.alpha)  # type: ignore[arg-type]

    def _score(self, task: Task, completion: str) -> float:
        # The inner reward ignores the prompt, so it grades the wrapped task as its own.
        return self.inner._score(task, completion)
