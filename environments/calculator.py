"""`calc-arith`: `arithmetic` tasks with a calculator tool the model may call between its turns.

Each model turn is either a **tool call** or the **final answer**:
- a turn containing `<calc>EXPR</calc>` (after the last `</think>`) calls the calculator on the first
  such tag; the environment replies with one user message `<result>VALUE</result>` or
  `<error>WHY</error>` and the episode goes on;
- any other turn is the final answer, read like `arithmetic` (last `\\boxed{}`, else `<answer>`, else
  the last number); the episode ends. Reward 1 if it equals the reference exactly, else 0.
At most `MAX_CALLS` calls are answered: the turn after them must answer (`max_turns` = MAX_CALLS + 1);
a call in the last turn ends the episode unanswered (reward 0).

The calculator is a recursive-descent parser over integers, `+ - * / × ÷`, parentheses and unary
minus, evaluated with exact fractions. Budgets are sizes, not time: an expression of at most
`MAX_EXPR_CHARS` characters, operands of at most `MAX_DIGITS` digits, nesting at most `MAX_DEPTH`, every
intermediate numerator and denominator below 10**`MAX_RESULT_DIGITS`. Past any of them the reply is an
error, the same on every machine. No `eval`, no `ast`, no floats.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from fractions import Fraction

from pydantic import JsonValue

from protocol.errors import TaskEnvironmentError

from .answers import parse_number, strip_thinking
from .arithmetic import Arithmetic, final_number
from .episode import EpisodeState, MultiTurnEnvironment
from .task import Message, Task, make_task

MAX_CALLS = 2
MAX_EXPR_CHARS = 200
MAX_DIGITS = 12
MAX_DEPTH = 16
MAX_RESULT_DIGITS = 40

SYSTEM_PROMPT = (
    "Compute the value of the expression. You have a calculator: write <calc>EXPRESSION</calc> "
    "(integers, + - * / and parentheses) and it replies <result>VALUE</result>. When you know the "
    "value, reply with only: Answer: VALUE"
)

_SPACE = " \t\r\n"
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_TOKEN = re.compile(r"[ \t\r\n]*(?:([0-9]+)|([-+*/×÷()]))")


class CalcError(ValueError):
    """The expression cannot be evaluated; the message is what the tool replies."""


def _bounded(value: Fraction) -> Fraction:
    limit = 10**MAX_RESULT_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise CalcError("result too large")
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        if len(text) > MAX_EXPR_CHARS:
            raise CalcError("expression too long")
        self.tokens: list[str] = []
        pos, end = 0, len(text.rstrip(_SPACE))
        while pos < end:
            m = _TOKEN.match(text, pos)
            if m is None:
                raise CalcError(f"unexpected character {text[pos:].lstrip(_SPACE)[:1]!r}")
            if m.group(1) is not None and len(m.group(1)) > MAX_DIGITS:
                raise CalcError("number too long")
            self.tokens.append(m.group(1) or {"×": "*", "÷": "/"}.get(m.group(2), m.group(2)))
            pos = m.end()
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("unexpected end of expression")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = _bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.unary(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.unary(depth)
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)
        return value

    def unary(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalcError("too deeply nested")
        if self.peek() == "-":
            self.take()
            return -self.unary(depth + 1)
        if self.peek() == "+":
            self.take()
            return self.unary(depth + 1)
        tok = self.take()
        if tok == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise CalcError("missing )")
            return value
        if tok.isascii() and tok.isdigit():
            return Fraction(int(tok))
        raise CalcError(f"unexpected {tok!r}")


def calculate(expression: str) -> Fraction:
    """The exact value of `expression`, or `CalcError` saying why not (see the module docstring)."""
    parser = _Parser(expression)
    if not parser.tokens:
        raise CalcError("empty expression")
    value = parser.expr(0)
    if parser.peek() is not None:
        raise CalcError(f"unexpected {parser.peek()!r}")
    return value


def show(value: Fraction) -> str:
    """An exact value as the tool writes it: `42`, `-7`, `5/3`."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def tool_reply(expression: str) -> str:
    """What the calculator says for `expression` (a result or an error, never an exception)."""
    try:
        return f"<result>{show(calculate(expression))}</result>"
    except CalcError as exc:
        return f"<error>{exc}</error>"


class CalcArith(MultiTurnEnvironment):
    """`arithmetic`'s generator (its own stream: seeds draw other expressions than `arithmetic`'s), with a
    calculator tool."""

    name = "calc-arith"
    version = "1"
    description = "arithmetic with a <calc> tool (up to 2 calls), exact-match reward on the final answer"
    max_turns = MAX_CALLS + 1

    _arithmetic = Arithmetic()

    def _generate(self, rng: random.Random) -> Task:
        inner = self._arithmetic._generate(rng)
        return self.task_from(inner.question(), inner.answer)

    def task_from(self, question: str, answer: str) -> Task:
        if parse_number(answer) is None:
            raise TaskEnvironmentError(f"calc-arith answer must be a number, got {answer!r}")
        expression = question.strip().removeprefix("What is ").removesuffix("?").strip()
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question))
        return make_task(self.name, self.version, messages, answer.strip(), info={"expression": expression})

    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        return {"calls": 0, "answer": None}

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        call = _CALL.search(strip_thinking(text))
        calls = int(data["calls"])  # type: ignore[arg-type]
        if call is None:
            got = final_number(text)
            correct = got is not None and got == parse_number(task.answer)
            return (), True, {"calls": calls, "answer": 1.0 if correct else 0.0}, None
        reply = tool_reply(call.group(1))
        return [Message(role="user", content=reply)], False, {"calls": calls + 1, "answer": None}, None

    def _final_reward(self, task: Task, state: EpisodeState) -> float:
        answer = state.data.get("answer")
        return float(answer) if isinstance(answer, float) else 0.0

    def _reference_turns(self, task: Task, env_seed: int) -> Sequence[str]:
        expression = str(task.info.get("expression", ""))
        return (f"<calc>{expression}</calc>", f"Answer: {task.answer}")
