"""`Environment.reward`'s contract: a float judges the answer; `UngradableError` means grading failed."""

from __future__ import annotations

import random

import pytest

import environments
from environments import Environment, Message, Task, UngradableError, make_task
from protocol.canonical import canonical_bytes
from protocol.errors import ProtocolError, TaskEnvironmentError


class Grader(Environment):
    """A grader whose own code fails on some answers: 'oom' allocates past any machine, 'bug' is one."""

    name = "test-grader"
    version = "1"

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from(f"say {rng.randrange(10)}", "ok")

    def task_from(self, question: str, answer: str) -> Task:
        return make_task(self.name, self.version, (Message(role="user", content=question),), answer)

    def _score(self, task: Task, completion: str) -> float:
        if completion == "oom":
            return float(len(bytearray(2**62)))  # a real MemoryError on the grader's side
        if completion == "bug":
            return float({}["missing"])  # type: ignore[index]
        if completion == "plumbing":  # a project error from the grader's own machinery
            return float(len(canonical_bytes("\ud800")))
        if completion == "bad task":
            raise TaskEnvironmentError("already classified: passes through")
        return 1.0 if completion == task.answer else 0.0


GRADER = Grader()
TASK = GRADER.sample(1, 1)[0]


def test_judged_answers_are_floats() -> None:
    assert GRADER.reward(TASK, "ok") == 1.0
    assert GRADER.reward(TASK, "wrong") == 0.0


@pytest.mark.parametrize(("completion", "cause"), [("oom", MemoryError), ("bug", KeyError),
                                                   ("plumbing", ProtocolError)])
def test_grader_failures_are_ungradable(completion: str, cause: type[BaseException]) -> None:
    with pytest.raises(UngradableError) as info:
        GRADER.reward(TASK, completion)
    assert isinstance(info.value.__cause__, cause) and info.value.code == "ungradable"
    wrapped = environments.LengthReward(GRADER, "exact")  # the wrapper never turns it into a 0
    with pytest.raises(UngradableError):
        wrapped.reward(wrapped.task_from(TASK.question(), "ok"), completion, completion_tokens=3)


def test_classified_errors_pass_through() -> None:
    with pytest.raises(TaskEnvironmentError) as info:
        GRADER.reward(TASK, "bad task")
    assert not isinstance(info.value, UngradableError)


def test_ungradable_is_an_environment_error() -> None:
    # Callers that catch TaskEnvironmentError keep working; the validator matches the subclass first.
    assert issubclass(UngradableError, TaskEnvironmentError)
    assert issubclass(environments.SandboxUnavailableError, UngradableError)
