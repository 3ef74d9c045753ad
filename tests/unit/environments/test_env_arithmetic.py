"""Known-answer table for arithmetic: answer forms, extraction precedence, adversarial text."""

from __future__ import annotations

import pytest

import environments

ENV = environments.get("arithmetic")
TASK = ENV.task_from("What is 6 × 7 × 25?", "1050")
NEG = ENV.task_from("What is 3 - 10?", "-7")

CASES: list[tuple[str, float]] = [
    ("1050", 1.0),
    ("\\boxed{1050}", 1.0),
    ("The answer is \\boxed{1,050}.", 1.0),
    ("6*7 = 42, 42*25 = 1050", 1.0),
    ("so it is 1050.", 1.0),
    ("1050.0", 1.0),
    ("\\boxed{1050.00}", 1.0),
    ("<answer>1050</answer>", 1.0),
    ("<answer> 1,050 </answer>", 1.0),
    ("\\boxed{2100/2}", 1.0),                                  # exact rationals compare exactly
    ("$\\boxed{1050}$", 1.0),
    ("\\boxed{1050} and later I mention 7", 1.0),              # boxed wins over a later number
    ("<think>maybe 1000</think>1050", 1.0),
    ("<think>1050</think>1000", 0.0),                          # only the post-thinking text counts
    ("1051", 0.0),
    ("1050.5", 0.0),
    ("-1050", 0.0),
    ("\\boxed{1000} 1050", 0.0),                               # a box commits to its content
    ("\\boxed{}", 0.0),
    ("no number here", 0.0),
    ("", 0.0),
    ("1050 is wrong, it is 1060", 0.0),                        # last number wins
    ("10 50", 0.0),
    ("1e3", 0.0),
    ("\\boxed{1050", 1.0),                                     # unclosed box: fall back to last number
    ("9" * 5_000_000, 0.0),                                    # 5 MB of digits: bounded, no hang
    ("x" * 10_000_000 + " 1050", 1.0),                         # 10 MB of noise then the answer
    ("1050" + " " * 1_000_000, 1.0),
    ("\\boxed{" * 100_000, 0.0),
    ("<answer>" * 100_000 + "1050", 1.0),
    ("１０５０", 1.0),                                          # Unicode decimal digits read as digits
]

NEG_CASES: list[tuple[str, float]] = [
    ("-7", 1.0), ("\\boxed{-7}", 1.0), ("−7", 1.0), ("7", 0.0), ("= -7.0", 1.0), ("-14/2", 1.0),
]


@pytest.mark.parametrize(("completion", "expected"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_known_answers(completion: str, expected: float) -> None:
    assert ENV.reward(TASK, completion) == expected


@pytest.mark.parametrize(("completion", "expected"), NEG_CASES)
def test_negative_answers(completion: str, expected: float) -> None:
    assert ENV.reward(NEG, completion) == expected


def test_table_size() -> None:
    assert len(CASES) + len(NEG_CASES) >= 30


def test_generated_answers_are_right() -> None:
    # Recompute every generated expression independently with Python's evaluator.
    for task in ENV.sample(99, 300):
        expr = task.question().removeprefix("What is ").removesuffix("?")
        value = eval(expr.replace("×", "*").replace("÷", "/"), {"__builtins__": {}})  # our own text
        assert value == int(task.answer), task.question()
        assert ENV.reward(task, f"\\boxed{{{task.answer}}}") == 1.0


def test_bad_reference_answer_is_typed_error() -> None:
    with pytest.raises(environments.registry.TaskEnvironmentError):
        ENV.task_from("What?", "seven")
