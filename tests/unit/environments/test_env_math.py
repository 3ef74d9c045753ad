"""Known-answer table for math: equivalent forms agree, near misses do not, hostile input is bounded."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import environments
from environments.math_verifier import MathVerifier
from protocol.errors import UngradableError

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
    (INT, "\\boxed{9^{9^{9^{9}}}}", 0.0),                     # a power tower uses up its CPU budget: 0
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


def test_worker_that_cannot_start_is_ungradable_not_zero() -> None:
    # The grader's own failure (here: no time to import sympy) says nothing about the answer.
    verifier = MathVerifier(start_timeout_s=0.001)
    env = type(ENV)(verifier)
    with pytest.raises(UngradableError, match="did not start"):
        env.reward(INT, "\\boxed{21}")
    assert verifier._worker is None  # killed; a later check starts a fresh one
    verifier.close()


@pytest.fixture
def verifier() -> Iterator[MathVerifier]:
    # 3 s of wall time per check: a stopped worker is caught quickly; start-up keeps its 60 s.
    v = MathVerifier(hard_timeout_s=3.0, cpu_budget_s=1.0)
    yield v
    v.close()


def starve(verifier: MathVerifier) -> int:
    """Start the worker if needed and stop it (SIGSTOP): a grader so loaded it gets no CPU."""
    verifier.check("1", "\\boxed{1}")
    assert verifier._worker is not None
    pid = verifier._worker.proc.pid
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.mark.timeout(120)
def test_starved_worker_is_ungradable_then_recovers(verifier: MathVerifier) -> None:
    """An overloaded grader cannot fail an honest answer: no reward at all, not a 0."""
    env = type(ENV)(verifier)
    stopped = starve(verifier)
    with pytest.raises(UngradableError, match="overloaded"):
        env.reward(INT, "\\boxed{21}")
    assert verifier._worker is None and not Path(f"/proc/{stopped}").exists()  # killed, reaped
    wrapped = environments.LengthReward(env, "max")
    starve(verifier)
    with pytest.raises(UngradableError):  # through the length wrapper too
        wrapped.reward(wrapped.task_from(INT.question(), "21"), "\\boxed{21}")
    assert env.reward(INT, "\\boxed{21}") == 1.0  # a fresh worker grades again


@pytest.mark.timeout(120)
def test_expensive_answer_is_zero_not_ungradable() -> None:
    # CPU time is the answer's cost whatever the load: exhausting the budget is its own fault.
    # (The default 30 s of wall time per check leaves a loaded machine room to spend 1 s of CPU.)
    verifier = MathVerifier(cpu_budget_s=1.0)
    env = type(ENV)(verifier)
    assert env.reward(INT, "\\boxed{9^{9^{9^{9}}}}") == 0.0
    assert env.reward(INT, "\\boxed{21}") == 1.0
    verifier.close()


def test_worker_death_mid_check_is_ungradable(verifier: MathVerifier) -> None:
    env = type(ENV)(verifier)
    assert env.reward(INT, "\\boxed{21}") == 1.0
    assert verifier._worker is not None
    worker = verifier._worker.proc.pid
    killer = threading.Timer(0.3, os.kill, (worker, signal.SIGKILL))
    killer.start()  # dies while it works on a slow answer (the budget is 1 s of CPU)
    with pytest.raises(UngradableError, match="died|gone"):  # gone: killed before it was asked
        env.reward(INT, "\\boxed{9^{9^{9^{9}}}}")
    killer.join()
