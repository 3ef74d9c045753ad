"""`lowercase`: write lowercase letters; reward = fraction of the completion's characters that are `a`-`z`.

A task a tiny random model visibly learns within minutes of GRPO (the mean reward rises from the
vocabulary's share of lowercase letters towards 1), so the one-command devnet and the learning
benchmark show learning on two CPU cores. Not a capability benchmark: the prompt only varies the seed.
"""

from __future__ import annotations

import random

from .base import Environment
from .task import Message, Task, make_task

LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")


class Lowercase(Environment):
    """Reward = fraction of the completion's characters that are lowercase ASCII letters (0 when empty)."""

    name = "lowercase"
    version = "1"
    description = "write lowercase letters; reward = fraction of the completion's characters in a-z"

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from("write letters " + str(rng.randrange(1000)), "")

    def task_from(self, question: str, answer: str) -> Task:
        return make_task(self.name, self.version, (Message(role="user", content=question),), answer)

    def _score(self, task: Task, completion: str) -> float:
        return sum(c in LETTERS for c in completion) / max(1, len(completion))
