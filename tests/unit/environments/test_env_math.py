"""Known-answer table for math: equivalent forms agree, near misses do not, hostile input is bounded."""

from __future__ import annotations

import threading
import time

import pytest

import environments
from environments.math_verifier import MathVerifier

ENV = environments.get("math")
HALF = ENV.task_from("What is 1/2 as a fraction?", "\\frac{1}{2}")
RADICAL = ENV.task_from("Simplify sqrt(72).", "6\\sqrt{2}")
PI = ENV.task_from("Area of a circle of radius 5?", "25\\pi")
NEG = ENV.task_from("Solve 2x + 7 = 0.", "-\\frac{7}{2}")
INT = ENV.task_from("Compute C(7,2).", "21")

CASES: list[tuple[object, str, float]] = [
    (HALF, "\\boxed{\\frac{1}{2}}", 1.0),
    (HALF, "0.5", 1.0),
    (HALF, "1/2", 1.0),
    (HALF, "The answer is $\\dfrac12$.", 1.0),
    (HALF, "\\boxed{0.50}", 1.0),
    (HALF, "\\boxed{2/4}", 1.0),
    (HALF, "\\boxed{\\tfrac{1}{2}}", 1.0),
    (HALF, "So $x = \\frac{1}{2}$", 1.0),
    (HALF, "<think>maybe 1/3</think> \\boxed{\\frac12}", 1.0),
    (HALF, "\\boxed{50\\%}", 1.0),
    (HALF, "\\boxed{\\frac{1}{3}}", 0.0),
    (HALF, "\\boxed{2}", 0.0),
    (HALF, "\\boxed{0.51}", 0.0),
    (HALF, "", 0.0),
    (HALF, "I don't know", 0.0),
    (HALF, "\\boxed{1/2} no wait \\boxed{1/3}", 0.0),          # the last box is the commitment
    (RADICAL, "\\boxed{6\\sqrt{2}}", 1.0),
    (RADICAL, "\\boxed{\\sqrt{72}}", 1.0),
    (RADICAL, "\\boxed{6\\sqrt2}", 1.0),
    (RADICAL, "\\boxed{3\\sqrt{8}}", 1.0),
    (RADICAL, "\\boxed{8.485}", 0.0),                          # a rounded decimal is not exact
    (RADICAL, "\\boxed{6\\sqrt{3}}", 0.0),
    (PI, "\\boxed{25\\pi}", 1.0),
    (PI, "\\boxed{25 \\pi}", 1.0),
    (PI, "\\boxed{\\pi \\cdot 25}", 1.0),
    (PI, "\\boxed{25}", 0.0),
    (PI, "\\boxed{5\\pi}", 0.0),
    (NEG, "\\boxed{-\\frac{7}{2}}", 1.0),
    (NEG, "\\boxed{-3.5}", 1.0),
    (NEG, "$x = -7/2$", 1.0),
    (NEG, "\\boxed{\\frac{-7}{2}}", 1.0),
    (NEG, "\\boxed{\\frac{7}{2}}", 0.0),
    (INT, "\\boxed{21}", 1.0),
    (INT, "\\boxed{21.0}", 1.0),
    (INT, "\\boxed{\\dbinom{7}{2}}", 1.0),
    (INT, "\\boxed{22}", 0.0),
    (INT, "x" * 10_000_000, 0.0),                             # 10 MB: only the tail is parsed
    (INT, "x" * 10_000_000 + " \\boxed{21}", 1.0),
    (INT, "\\boxed{" + "(" * 3000 + "21" + ")" * 3000 + "}", 0.0),
    (INT, "\\boxed{9^{9^{9^{9}}}}", 0.0),                     # a power tower times out, scores 0
    (INT, "\\boxed{\\boxed{\\boxed{21}}}", 1.0),
]


@pytest.mark.parametrize(("task", "completion", "expected"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_known_answers(task: environments.Task, completion: str, expected: float) -> None:
    started = time.monotonic()
    assert ENV.reward(task, completion) == expected
    assert time.monotonic() - started < 30


def test_table_size() -> None:
    assert len(CASES) >= 30


def test_generated_references_verify_against_themselves() -> None:
    for task in ENV.sample(2024, 40):
        assert ENV.reward(task, f"Final answer: \\boxed{{{task.answer}}}") == 1.0, task.question()


def test_reward_off_main_thread_uses_the_worker() -> None:
    verifier = MathVerifier()
    env = type(ENV)(verifier)
    out: list[float] = []

    def grade() -> None:
        out.extend(env.reward(HALF, c) for c in ("0.5", "\\boxed{\\frac{1}{3}}", "\\boxed{9^{9^{9^{9}}}}",
                                                 "\\boxed{1/2}"))

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join(120)
    verifier.close()
    assert out == [1.0, 0.0, 0.0, 1.0]


def test_worker_overrun_is_killed_and_scores_zero() -> None:
    verifier = MathVerifier(hard_timeout_s=0.001)  # the worker cannot even import sympy in time
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(verifier.check("1", "\\boxed{1}")))
    thread.start()
    thread.join(60)
    assert result == [False]
    assert verifier._worker is None  # killed, restarted lazily on the next call
    verifier.close()
