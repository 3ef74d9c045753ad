"""`code`: write a Python function; graded by hidden input/output tests run in a sandboxed process.

Reward = fraction of hidden tests whose return value equals the expected one after a JSON round trip
(tuples compare as lists; floats within 1e-6 relative). Partial credit gives GRPO a gradient.

Code extraction: text after the last `</think>`; the content of the last fenced block
(```` ```python ... ``` ```` or any ```` ``` ```` fence; an unclosed last fence runs to the end); with no
fence, the whole text. Code over `MAX_CODE_CHARS` scores 0 without being run. Code that fails,
crashes or times out in the sandbox loses those tests; a sandbox that cannot isolate or start raises
`UngradableError` (see `sandbox`).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from pydantic import JsonValue

from protocol.errors import TaskEnvironmentError

from .answers import strip_thinking
from .base import Environment
from .code_problems import FAMILIES, reference_outputs
from .sandbox import SandboxLimits, run_sandboxed
from .task import HiddenTest, Message, Task, make_task

MAX_CODE_CHARS = 64 * 1024

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Reply with the complete function in a single "
    "```python code block. Use only the standard library."
)


def extract_code(completion: str) -> str:
    """The code part of a completion (see the module docstring for the rule)."""
    text = strip_thinking(completion)
    close = text.rfind("```")
    if close < 0:
        return text.strip()
    opening = text.rfind("```", 0, close)
    if opening < 0:  # a single fence: an unclosed block runs from it to the end
        opening, close = close, len(text)
    body = text[opening + 3: close]
    first_nl = body.find("\n")
    # The fence's info string ("python", "py3", "") sits before the first newline.
    if first_nl >= 0 and " " not in body[:first_nl].strip():
        body = body[first_nl + 1:]
    return body.strip("\n")


def same_value(expected: Any, got: Any) -> bool:
    """JSON-value equality, with a tolerance for floats and no bool/int confusion."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is type(got) and expected == got
    if isinstance(expected, float) or isinstance(got, float):
        return (isinstance(got, (int, float)) and isinstance(expected, (int, float))
                and math.isclose(expected, got, rel_tol=1e-6, abs_tol=1e-9))
    if isinstance(expected, list):
        return (isinstance(got, list) and len(got) == len(expected)
                and all(same_value(e, g) for e, g in zip(expected, got, strict=True)))
    if isinstance(expected, dict):
        return (isinstance(got, dict) and got.keys() == expected.keys()
                and all(same_value(expected[k], got[k]) for k in expected))
    return type(expected) is type(got) and expected == got


class CodeEnvironment(Environment):
    """Eleven procedural function-writing families, 9-14 hidden tests each."""

    name = "code"
    version = "1"
    description = "write a Python function; reward = share of hidden tests passed in a sandbox"

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()

    def _generate(self, rng: random.Random) -> Task:
        problem = rng.choice(FAMILIES)(rng)
        inputs = json.loads(json.dumps(problem.inputs))  # the candidate sees JSON-decoded values
        expected = json.loads(json.dumps(reference_outputs(problem)))
        spec = {"entry_point": problem.entry_point,
                "tests": [{"args": a, "expected": e} for a, e in zip(inputs, expected, strict=True)]}
        return self._build(problem.statement, problem.reference, spec)

    def task_from(self, question: str, answer: str) -> Task:
        """`answer` is JSON: `{"entry_point": str, "tests": [{"args": [...], "expected": v}, ...]}`
        (a reference solution may ride along as `"reference"`)."""
        try:
            spec = json.loads(answer)
            reference = str(spec.get("reference", ""))
        except (ValueError, AttributeError) as exc:
            raise TaskEnvironmentError(f"code answer must be a JSON object: {exc}") from exc
        return self._build(question, reference, spec)

    def _build(self, statement: str, reference: str, spec: dict[str, Any]) -> Task:
        try:
            entry = spec["entry_point"]
            tests = tuple(HiddenTest(args=tuple(t["args"]), expected=t["expected"]) for t in spec["tests"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskEnvironmentError(f"bad code task spec: {exc!r}") from exc
        if not isinstance(entry, str) or not entry.isidentifier() or not tests:
            raise TaskEnvironmentError("code task needs an identifier entry_point and at least one test")
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=statement))
        info: dict[str, JsonValue] = {"entry_point": entry}
        return make_task(self.name, self.version, messages, reference, tests=tests, info=info)

    def _score(self, task: Task, completion: str) -> float:
        code = extract_code(completion[-4 * MAX_CODE_CHARS:])
        if not code.strip() or len(code) > MAX_CODE_CHARS:
            return 0.0
        entry = str(task.info["entry_point"])
        result = run_sandboxed(code, entry, [list(t.args) for t in task.tests], self.limits)
        passed = sum(1 for t, got in zip(task.tests, result.values, strict=True)
                     if isinstance(got, dict) and "value" in got and same_value(t.expected, got["value"]))
        return passed / len(task.tests)
