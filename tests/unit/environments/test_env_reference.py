"""`Environment.reference_completion`: the graded form of a task's reference answer (SFT warm-up data)."""

from __future__ import annotations

import pytest

import environments
from protocol.errors import TaskEnvironmentError


@pytest.mark.parametrize("name", ["reverse-text", "arithmetic"])
def test_reference_completion_earns_full_reward(name: str) -> None:
    env = environments.get(name)
    for seed in range(200):
        task = env.sample(seed, 1)[0]
        completion = env.reference_completion(task)
        assert env.reward(task, completion) == 1.0, (task.question(), completion)


def test_reference_completion_shapes() -> None:
    rev = environments.get("reverse-text")
    assert rev.reference_completion(rev.task_from("hello world", "dlrow olleh")) == "<answer>dlrow olleh</answer>"
    ari = environments.get("arithmetic")
    assert ari.reference_completion(ari.task_from("What is 2 - 9?", "-7")) == "\\boxed{-7}"


def test_reference_completion_refused_where_not_stated() -> None:
    rev = environments.get("reverse-text")
    task = rev.sample(0, 1)[0]
    with pytest.raises(TaskEnvironmentError, match="reverse-text@1"):
        environments.get("arithmetic").reference_completion(task)  # another environment's task
    wrapped = environments.get("reverse-text+length-max")
    with pytest.raises(TaskEnvironmentError, match="cannot state a reference completion"):
        wrapped.reference_completion(wrapped.sample(0, 1)[0])
