"""`math`: competition-style problems; a completion is right when its final answer is
mathematically equivalent to the reference (`math-verify`: `1/2`, `0.5` and `\\boxed{\\frac{1}{2}}`
agree). Reward 1 or 0.

Extraction: text after the last `</think>`; of that, the last `MAX_PRED_CHARS` characters go to
`math-verify`, which prefers the last `\\boxed{}` and otherwise takes the last LaTeX or plain
expression. Grading runs in a worker process (see `math_verifier`): an answer that exhausts its CPU
budget scores 0; a check the grader could not do (starved, worker dead) raises `UngradableError`.
"""

from __future__ import annotations

import random

from protocol.errors import TaskEnvironmentError

from .answers import strip_thinking
from .base import Environment
from .math_problems import FAMILIES
from .math_verifier import MAX_PRED_CHARS, MathVerifier
from .task import Message, Task, make_task

SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then put your final answer inside \\boxed{}."
)


class MathEnvironment(Environment):
    """Twelve procedural problem families (fractions, equations, radicals, probability, ...)."""

    name = "math"
    version = "1"
    description = "procedural math problems; reward = math-verify equivalence with the reference"

    def __init__(self, verifier: MathVerifier | None = None) -> None:
        self.verifier = verifier or MathVerifier()

    def _generate(self, rng: random.Random) -> Task:
        family = rng.choice(FAMILIES)
        question, answer = family(rng)
        return self.task_from(question, answer)

    def task_from(self, question: str, answer: str) -> Task:
        if not answer.strip():
            raise TaskEnvironmentError("math answer must not be empty")
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question))
        return make_task(self.name, self.version, messages, answer.strip())

    def _score(self, task: Task, completion: str) -> float:
        tail = strip_thinking(completion)[-MAX_PRED_CHARS:]
        return 1.0 if self.verifier.check(task.answer, tail) else 0.0
