"""Rewards recomputed with the run's environment: the one place a validator runs its grader.

A grader is code that can fail on our side (a sandbox that died, a math worker that timed out): callers treat
every exception from here as the validator's failure, never the node's (`UngradableError` names it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from environments import Task
    from models.loading import LoadedModel
    from protocol.rollout import Submission
    from validator.assignment import Assignment


class Grader:
    """Grades completions with the run's environment (`Assignment.env`, looked up at each call)."""

    def __init__(self, assignment: Assignment) -> None:
        self.assignment = assignment

    def grade(self, loaded: LoadedModel, task: Task, tokens: tuple[int, ...]) -> float:
        """The environment's reward for a completion's tokens (special tokens dropped from the text)."""
        text = str(loaded.tokenizer.decode(list(tokens), skip_special_tokens=True))
        return float(self.assignment.env.reward(task, text, completion_tokens=len(tokens)))

    def rewards(self, loaded: LoadedModel, sub: Submission, tasks: list[Task]) -> list[list[float]]:
        """Our reward of every sample of `sub`, per task."""
        return [[self.grade(loaded, task, s.tokens) for s in tr.samples]
                for task, tr in zip(tasks, sub.tasks, strict=True)]
