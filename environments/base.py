"""The environment interface: deterministic sampling from an integer seed, and a pure reward."""

from __future__ import annotations

import hashlib
import logging
import random
from abc import ABC, abstractmethod
from typing import ClassVar

from protocol.errors import TaskEnvironmentError, UngradableError

from .task import Task

log = logging.getLogger(__name__)

MAX_SAMPLE = 4096
"""Most tasks one `sample` call may draw (a bound, so a bad request cannot allocate without limit)."""

MAX_SEED = 2**256
"""Seeds are non-negative integers below this (the protocol derives 256-bit seeds from a hash)."""


def task_rng(env_name: str, seed: int, index: int) -> random.Random:
    """The random stream of task `index` drawn from `seed`.

    Why not `random.Random(seed)` once for all tasks: deriving one stream per index makes task i
    independent of how many tasks were drawn before it. Why blake2b and not `hash()`: `hash()` of a
    str is salted per process. `random.Random` seeded with an int gives the same stream on every
    platform; generators call only `randrange`/`randint`/`choice`/`sample`/`shuffle` with int
    arguments, all built on `getrandbits` through `_randbelow`, unchanged since Python 3.2. A test
    pins known tasks so a change in that guarantee would be caught, not silently forked.
    """
    material = f"{env_name}\x00{seed}\x00{index}".encode()
    return random.Random(int.from_bytes(hashlib.blake2b(material, digest_size=32).digest(), "big"))


class Environment(ABC):
    """One task family: `sample(seed, n)` draws tasks, `reward(task, completion)` grades them.

    Subclasses set `name` and `version` (bump the version whenever generation or grading changes:
    node and validator must run the same code for the same version) and implement `_generate`,
    `_score` and `task_from`.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    description: ClassVar[str] = ""

    def sample(self, seed: int, n: int) -> list[Task]:
        """Draw `n` tasks from `seed`; the same on every machine, process and Python 3.11+."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
            raise TaskEnvironmentError(f"seed must be an int in [0, 2**256), got {seed!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_SAMPLE:
            raise TaskEnvironmentError(f"n must be an int in [0, {MAX_SAMPLE}], got {n!r}")
        return [self._generate(task_rng(self.name, seed, i)) for i in range(n)]

    def reward(self, task: Task, completion: str, *, completion_tokens: int | None = None) -> float:
        """Score `completion` for `task` in [0, 1]; pure and deterministic.

        `completion_tokens` is the completion's length in tokens; only length-aware wrappers use it.

        The contract, for node, validator and trainer alike:
        - a float is a judgement of the answer: a wrong, malformed, oversized or too-expensive answer
          (one that exhausts a budget that does not depend on the grader's load, e.g. CPU time, or
          candidate code that crashes or times out in the sandbox) gets a low reward;
        - `UngradableError` means grading itself failed and says nothing about the answer: a
          timeout on a starved grader, a dead worker, a sandbox that could not start or cannot
          isolate here, the grader out of memory, a bug in the grader. Never record it as 0 (an
          honest node would be slashed for a validator's overload): drop the sample or give a
          soft verdict;
        - `TaskEnvironmentError` (other subclasses): the task belongs to another environment or
          version, or the arguments are wrong: the caller's mistake.
        """
        self._check_task(task)
        if not isinstance(completion, str):
            raise TaskEnvironmentError(f"completion must be str, got {type(completion).__name__}")
        try:
            score = float(self._score(task, completion))
        except TaskEnvironmentError:
            raise  # already classified (UngradableError, a bad task...)
        except MemoryError as exc:
            raise UngradableError(f"{self.name}: the grader ran out of memory") from exc
        except Exception as exc:  # the grading code or its plumbing failed: no judgement of the answer
            log.warning("%s@%s: grading failed with %r", self.name, self.version, exc)
            raise UngradableError(f"{self.name}: grading failed: {exc!r}") from exc
        # Clamp and kill NaN: a reward outside [0, 1] would poison a GRPO group's advantages.
        return min(1.0, max(0.0, score)) if score == score else 0.0

    def reference_completion(self, task: Task) -> str:
        """A completion that states `task`'s reference answer the way the grader reads it (full reward).

        Supervised warm-up data (`prime-trainer sft`) is built from it. Environments whose reference
        answer cannot be written as a graded completion do not override it and raise.
        """
        raise TaskEnvironmentError(f"{self.name} cannot state a reference completion for its tasks")

    def _check_task(self, task: Task) -> None:
        if task.env != self.name or task.env_version != self.version:
            raise TaskEnvironmentError(
                f"task is for {task.env}@{task.env_version}, this is {self.name}@{self.version}")

    @abstractmethod
    def task_from(self, question: str, answer: str) -> Task:
        """A task built from a question and its reference answer (evaluation and held-out sets)."""

    @abstractmethod
    def _generate(self, rng: random.Random) -> Task:
        """One task from its own random stream."""

    @abstractmethod
    def _score(self, task: Task, completion: str) -> float:
        """The reward before clamping."""
