"""`arithmetic`: procedurally generated integer expressions with exact answers; reward 1 or 0.

Answer extraction: after the last `</think>`, the content of the last `\\boxed{}`, else of the last
`<answer>` tag, else the whole text; within it, the last number (`1,234`, `-7`, `12.0`, `3/1` all
read as exact rationals). Correct means equal to the reference exactly.
"""

from __future__ import annotations

import random
from fractions import Fraction

from protocol.errors import TaskEnvironmentError

from .answers import last_boxed, last_number, last_tagged, parse_number, strip_thinking
from .base import Environment
from .task import Message, Task, make_task

SYSTEM_PROMPT = (
    "Compute the value of the expression. Think briefly, then give the final integer answer "
    "inside \\boxed{}."
)


def final_number(completion: str) -> Fraction | None:
    """The number a completion commits to (see the module docstring)."""
    text = strip_thinking(completion)
    for part in (last_boxed(text), last_tagged(text, "answer")):
        if part is not None:
            return last_number(part)
    return last_number(text)


class Arithmetic(Environment):
    """Two to four integer operands with +, -, * and exact division, sometimes parenthesized."""

    name = "arithmetic"
    version = "1"
    description = "integer expressions; exact-match reward on the last boxed/tagged/written number"

    def _operand(self, rng: random.Random) -> int:
        return rng.randint(-20, 99) if rng.random() < 0.2 else rng.randint(1, 99)

    def _generate(self, rng: random.Random) -> Task:
        n_ops = rng.randint(1, 3)
        expr = str(self._operand(rng))
        value = Fraction(int(expr))
        for _ in range(n_ops):
            op = rng.choice("+-*/")
            if op == "/":
                # Exact division only: pick a divisor of the running value (or multiply it up).
                if value == 0 or value.denominator != 1:
                    op = "+"
                else:
                    divisors = [d for d in range(2, 13) if int(value) % d == 0]
                    if not divisors:
                        op = "*"
            rhs = rng.choice(divisors) if op == "/" else self._operand(rng)
            shown = f"({rhs})" if rhs < 0 else str(rhs)
            # Parenthesize the left side when precedence would otherwise change its meaning.
            left = f"({expr})" if op in "*/" and any(c in expr[1:] for c in "+-") else expr
            expr = f"{left} {op} {shown}"
            if op == "+":
                value += rhs
            elif op == "-":
                value -= rhs
            elif op == "*":
                value *= rhs
            else:
                value /= rhs
        expr = expr.replace("*", "×").replace("/", "÷")
        return self.task_from(f"What is {expr}?", str(int(value)))

    def task_from(self, question: str, answer: str) -> Task:
        if parse_number(answer) is None:
            raise TaskEnvironmentError(f"arithmetic answer must be a number, got {answer!r}")
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question))
        return make_task(self.name, self.version, messages, answer.strip())

    def reference_completion(self, task: Task) -> str:
        """The exact value, boxed as the system prompt asks."""
        self._check_task(task)
        return f"\\boxed{{{task.answer}}}"

    def _score(self, task: Task, completion: str) -> float:
        got = final_number(completion)
        return 1.0 if got is not None and got == parse_number(task.answer) else 0.0
