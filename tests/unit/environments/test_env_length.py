"""Known-answer table for the length wrapper: exact / max / clip, token counts and the char fallback."""

from __future__ import annotations

import pytest

import environments
from environments.length import LengthReward, completion_length, length_factor
from protocol.errors import TaskEnvironmentError

ARITH = environments.get("arithmetic")

# (mode, inner reward, length, target, alpha, expected)
FACTOR_CASES: list[tuple[str, float, int, int, float, float]] = [
    ("exact", 1.0, 100, 100, 0.5, 1.0),
    ("exact", 1.0, 50, 100, 0.5, 0.75),
    ("exact", 1.0, 150, 100, 0.5, 0.75),
    ("exact", 1.0, 0, 100, 0.5, 0.5),
    ("exact", 1.0, 300, 100, 0.5, 0.0),
    ("exact", 1.0, 1000, 100, 0.5, 0.0),                  # clamped at 0
    ("exact", 0.0, 100, 100, 0.5, 0.0),
    ("exact", 0.6, 120, 100, 1.0, 0.4),
    ("exact", 1.0, 100, 100, 0.0, 1.0),
    ("exact", 1.0, 10**9, 100, 0.0, 1.0),                 # alpha 0: no length effect
    ("max", 1.0, 50, 100, 0.5, 1.0),                      # under budget: free
    ("max", 1.0, 0, 100, 0.5, 1.0),
    ("max", 1.0, 100, 100, 0.5, 1.0),
    ("max", 1.0, 150, 100, 0.5, 0.75),
    ("max", 1.0, 200, 100, 0.5, 0.5),
    ("max", 1.0, 300, 100, 0.5, 0.0),
    ("max", 1.0, 10**9, 100, 0.5, 0.0),
    ("max", 0.5, 150, 100, 0.5, 0.375),
    ("max", 0.0, 10, 100, 0.5, 0.0),
    ("max", 1.0, 150, 100, 2.0, 0.0),
    ("clip", 1.0, 100, 100, 0.5, 1.0),
    ("clip", 1.0, 101, 100, 0.5, 0.0),
    ("clip", 1.0, 0, 100, 0.5, 1.0),
    ("clip", 0.3, 99, 100, 0.5, 0.3),
    ("clip", 0.3, 10**9, 100, 0.5, 0.0),
    ("clip", 0.0, 1, 100, 0.5, 0.0),
]


@pytest.mark.parametrize(("mode", "r", "length", "target", "alpha", "expected"), FACTOR_CASES)
def test_length_factor(mode: str, r: float, length: int, target: int, alpha: float, expected: float) -> None:
    assert length_factor(mode, r, length, target, alpha) == pytest.approx(expected)


def test_wrapped_rewards_end_to_end() -> None:
    env = environments.get("arithmetic+length-max")
    task = env.task_from("What is 2 + 2?", "4", target_length=100)
    assert "Think for about 100 tokens" in task.messages[0].content
    assert task.info["target_length"] == 100
    right, wrong = "\\boxed{4}", "\\boxed{5}"
    cases = [
        (right, None, 1.0), (right, 100, 1.0), (right, 150, 0.75), (right, 300, 0.0),
        (wrong, 10, 0.0), ("x" * 791 + right, None, 0.5),  # 800 chars -> 200 "tokens" by the fallback
    ]
    for completion, tokens, expected in cases:
        assert env.reward(task, completion, completion_tokens=tokens) == pytest.approx(expected, abs=0.02)
    exact = environments.get("reverse-text+length-exact")
    t2 = exact.task_from("abc", "cba", target_length=10)
    assert exact.reward(t2, "cba", completion_tokens=10) == 1.0
    assert exact.reward(t2, "cba", completion_tokens=5) == 0.75
    assert exact.reward(t2, "cb", completion_tokens=10) == pytest.approx(2 / 3)
    clip = environments.get("math+length-clip")
    t3 = clip.task_from("1/2?", "\\frac{1}{2}", target_length=8)
    assert clip.reward(t3, "\\boxed{0.5}", completion_tokens=8) == 1.0
    assert clip.reward(t3, "\\boxed{0.5}", completion_tokens=9) == 0.0


def test_table_size() -> None:
    assert len(FACTOR_CASES) + 6 + 5 >= 30


def test_targets_are_sampled_and_stated() -> None:
    env = LengthReward(ARITH, mode="exact", targets=(32, 64))
    tasks = env.sample(5, 40)
    assert {t.info["target_length"] for t in tasks} == {32, 64}
    for t in tasks:
        assert f"about {t.info['target_length']} tokens" in t.messages[0].content
        assert t.env == "arithmetic+length-exact" and t.env_version == "1.length1"


def test_bad_inputs_are_typed_errors() -> None:
    env = environments.get("arithmetic+length-max")
    task = env.task_from("What is 1?", "1")
    for bad in (-1, True, 1.5):
        with pytest.raises(TaskEnvironmentError):
            env.reward(task, "1", completion_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(TaskEnvironmentError):
        LengthReward(ARITH, mode="median")  # type: ignore[arg-type]
    with pytest.raises(TaskEnvironmentError):
        LengthReward(ARITH, targets=(0,))
    with pytest.raises(TaskEnvironmentError):
        ARITH.reward(task, "1")  # a wrapped task is not the inner env's task
    assert completion_length("abcdefghi", None) == 3
