"""A task: what a node is asked, and everything its reward needs, as one frozen, hashable-by-id record.

A task travels between node and validator only as (environment name, version, seed, index): both sides
rebuild it with `env.sample(seed, n)`. The `task_id` is a digest of the task's content, so two machines
that rebuilt the same task agree on its id byte for byte, and a submission can name its tasks by id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue


class Message(BaseModel):
    """One chat turn, in the shape `tokenizer.apply_chat_template` takes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant"]
    """Who speaks."""
    content: str
    """What is said."""


class HiddenTest(BaseModel):
    """One hidden input/output case of a `code` task: the grader calls the function with `args`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    args: tuple[JsonValue, ...]
    """Positional arguments, JSON values (lists stay lists: the function sees JSON-decoded input)."""
    expected: JsonValue
    """The expected return value after a JSON round trip (tuples compare as lists)."""


class Task(BaseModel):
    """A prompt plus what its reward needs. Frozen; `task_id` is derived from the content."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: str
    """Registry name of the environment that built (and grades) this task."""
    env_version: str
    """Version of that environment's generator and reward code; part of what a node signs."""
    task_id: str = ""
    """Hex digest of everything else (filled in by `make_task`; never chosen by hand)."""
    messages: tuple[Message, ...]
    """System and user turns; render with `environments.chat.render_prompt`."""
    answer: str
    """Reference answer (reversed text, number, LaTeX expression, or a reference solution for code)."""
    tests: tuple[HiddenTest, ...] = ()
    """Hidden tests (code tasks only); never shown in `messages`."""
    info: dict[str, JsonValue] = Field(default_factory=dict)
    """Environment-specific data the reward needs (e.g. `entry_point`, `target_length`)."""

    def question(self) -> str:
        """The last user turn (what an evaluation report shows)."""
        return next(m.content for m in reversed(self.messages) if m.role == "user")

    def as_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts, ready for `tokenizer.apply_chat_template`."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


def _canonical(payload: dict[str, Any]) -> bytes:
    # Sorted keys, no whitespace, UTF-8: the same bytes on every machine and Python version.
    # `surrogatepass`: a lone surrogate in an evaluation question must not crash id computation.
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def make_task(
    env: str,
    env_version: str,
    messages: list[Message] | tuple[Message, ...],
    answer: str,
    tests: tuple[HiddenTest, ...] = (),
    info: dict[str, JsonValue] | None = None,
) -> Task:
    """Build a task and stamp its content digest (blake2b-128 over canonical JSON) as `task_id`."""
    draft = Task(env=env, env_version=env_version, messages=tuple(messages), answer=answer,
                 tests=tests, info=dict(info or {}))
    body = draft.model_dump(mode="json", exclude={"task_id"})
    digest = hashlib.blake2b(_canonical(body), digest_size=16).hexdigest()
    return draft.model_copy(update={"task_id": digest})


def task_digest_ok(task: Task) -> bool:
    """True when `task.task_id` matches its content (a task received from elsewhere was not edited)."""
    body = task.model_dump(mode="json", exclude={"task_id"})
    return hashlib.blake2b(_canonical(body), digest_size=16).hexdigest() == task.task_id
