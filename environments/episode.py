"""Multi-turn environments: an episode is a pure function of (task, environment seed, model turns).

The model speaks, the environment answers (a tool's output, a scripted user), until the environment
says the episode is done or `max_turns` model turns were taken. Everything the environment says and
the reward it gives are determined by the task, the integer `env_seed` and the decoded text of the
model's turns, so a validator that replays the same turns gets the same messages and reward byte for
byte (environments/README.md, "Multi-turn environments", lists what that rules out).

    env = environments.get("calc-arith")
    task = env.sample(seed, 1)[0]
    state = env.start(task, env_seed)
    reply = env.step(task, state, model_text)     # EnvReply: messages, done, next state
    ...
    episode = env.replay(task, env_seed, turns)   # the whole episode again, reward included
"""

from __future__ import annotations

import copy
import logging
import random
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, JsonValue

from protocol.errors import TaskEnvironmentError, UngradableError

from .base import MAX_SEED, Environment, task_rng
from .task import Message, Task

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_TURN_CHARS = 65536
"""Longest decoded model turn an environment reads; longer text is cut to its first this many
characters before parsing (a bound the same on every machine, so a 10 MB turn costs nothing)."""


def episode_rng(env_name: str, task_id: str, env_seed: int, turn: int) -> random.Random:
    """The random stream an environment may draw from while answering model turn `turn` (0 = `start`).

    Built with `task_rng`'s construction (blake2b over the names, never `hash()` or the global
    `random`), one stream per turn, so a turn's draws do not depend on how many draws earlier turns
    made and the state never has to carry a generator.
    """
    return task_rng(f"{env_name}\x00episode\x00{task_id}", env_seed, turn)


def _clamp(score: float) -> float:
    # A reward outside [0, 1] or NaN would poison a GRPO group's advantages (as `Environment.reward`).
    return min(1.0, max(0.0, score)) if score == score else 0.0


def _utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class EpisodeState(BaseModel):
    """Where an episode stands after some model turns: a frozen value, JSON all the way down."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: str
    """Environment name (a state from another environment is refused)."""
    env_version: str
    """Environment version."""
    task_id: str
    """The task this episode plays."""
    env_seed: int
    """The seed the episode was started from."""
    turn: int = 0
    """Model turns consumed so far."""
    done: bool = False
    """True once the environment ended the episode (or `max_turns` was reached)."""
    turn_rewards: tuple[float, ...] = ()
    """Dense per-turn scores the environment recorded (environment-defined; may stay empty)."""
    data: dict[str, JsonValue] = {}
    """Environment-specific state (JSON values only, so it serializes and compares exactly)."""


class EnvReply(BaseModel):
    """The environment's answer to one model turn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: tuple[Message, ...]
    """What the environment says next (user-role messages: a tool's output, a scripted user);
    empty when `done` (the model never sees a message after the end)."""
    done: bool
    """The episode is over: no further model turn may follow."""
    state: EpisodeState
    """The state after this turn (pass it to the next `step`)."""


class Episode(BaseModel):
    """A whole episode replayed from (task, env_seed, turns): what a validator recomputes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    """The task played."""
    env_seed: int
    """The environment seed."""
    turns: tuple[str, ...]
    """The model's decoded turns, in order."""
    replies: tuple[tuple[Message, ...], ...]
    """The environment's messages after each turn (same length as `turns`; the last is empty when done)."""
    done: bool
    """Whether the environment ended the episode after the last turn."""
    turn_rewards: tuple[float, ...]
    """Dense per-turn scores, as the environment recorded them."""
    reward: float
    """The episode's reward in [0, 1]."""

    def conversation(self, task: Task) -> tuple[Message, ...]:
        """The task's prompt, then each model turn (assistant) and the environment's reply."""
        out = list(task.messages)
        for text, reply in zip(self.turns, self.replies, strict=True):
            out.append(Message(role="assistant", content=text))
            out.extend(reply)
        return tuple(out)


class MultiTurnEnvironment(Environment):
    """An environment whose episodes take several model turns; tasks are sampled as for `Environment`.

    Subclasses set `name`, `version`, `max_turns` and implement `_generate`, `task_from` (as single-turn
    environments do) and `_begin`, `_respond`, `_final_reward`, `_reference_turns`. Rules: no clock,
    no network, no files, no process-global or unseeded randomness (draw only from the `rng` given),
    no iteration over sets of strings, and every budget counted in operations or sizes, never in time.
    Bump `version` whenever any message, termination rule or reward changes.
    """

    max_turns: ClassVar[int]
    """Most model turns an episode takes; after that many the episode is done whatever was said."""

    # -- the episode ----------------------------------------------------------------------------

    def start(self, task: Task, env_seed: int) -> EpisodeState:
        """The state before the model's first turn (the task's own messages are the prompt)."""
        self._check_task(task)
        if isinstance(env_seed, bool) or not isinstance(env_seed, int) or not 0 <= env_seed < MAX_SEED:
            raise TaskEnvironmentError(f"env_seed must be an int in [0, 2**256), got {env_seed!r}")
        data = self._guarded(lambda: self._begin(task, episode_rng(self.name, task.task_id, env_seed, 0)))
        return EpisodeState(env=self.name, env_version=self.version, task_id=task.task_id,
                            env_seed=env_seed, data=data)

    def step(self, task: Task, state: EpisodeState, turn_text: str) -> EnvReply:
        """The environment's answer to the model's decoded turn `turn_text`; pure.

        Raises `TaskEnvironmentError` for a state of another task or environment, a state that is
        already done (a caller that continues after the end), or non-str text; `UngradableError`
        when the environment's own code fails (never a judgement of the turn).
        """
        self._check_task(task)
        if (state.env, state.env_version, state.task_id) != (self.name, self.version, task.task_id):
            raise TaskEnvironmentError("episode state belongs to another task or environment version")
        if state.done:
            raise TaskEnvironmentError(f"{self.name}: the episode is over; no turn may follow")
        if not isinstance(turn_text, str):
            raise TaskEnvironmentError(f"turn text must be str, got {type(turn_text).__name__}")
        turn = state.turn + 1
        rng = episode_rng(self.name, task.task_id, state.env_seed, turn)
        messages, done, data, score = self._guarded(
            lambda: self._respond(task, copy.deepcopy(state.data), state.turn, turn_text[:MAX_TURN_CHARS], rng))
        for m in messages:  # the environment's own bug, never the turn's: a message a tokenizer cannot encode
            if not isinstance(m, Message) or m.role == "assistant" or not _utf8_clean(m.content):
                raise UngradableError(f"{self.name}: the environment produced an invalid message {m!r:.80}")
        if not done and not messages:
            raise UngradableError(f"{self.name}: the environment went on without saying anything")
        done = done or turn >= self.max_turns
        rewards = state.turn_rewards if score is None else (*state.turn_rewards, _clamp(float(score)))
        next_state = EpisodeState(env=self.name, env_version=self.version, task_id=task.task_id,
                                  env_seed=state.env_seed, turn=turn, done=done, turn_rewards=rewards,
                                  data=data)
        return EnvReply(messages=() if done else tuple(messages), done=done, state=next_state)

    def replay(self, task: Task, env_seed: int, turns: Sequence[str]) -> Episode:
        """Play `turns` through the environment from `env_seed`: the messages, the end and the reward.

        A turn after the environment said done raises `TaskEnvironmentError` (the validator's
        `termination`); fewer turns than the environment needed give `done=False` and the reward
        of the unfinished episode.
        """
        state = self.start(task, env_seed)
        replies: list[tuple[Message, ...]] = []
        for text in turns:
            reply = self.step(task, state, text)
            replies.append(reply.messages)
            state = reply.state
        reward = self.score_state(task, state)
        return Episode(task_id=task.task_id, env_seed=env_seed, turns=tuple(turns), replies=tuple(replies),
                       done=state.done, turn_rewards=state.turn_rewards, reward=reward)

    def score_state(self, task: Task, state: EpisodeState) -> float:
        """The reward of the episode that reached `state`, clamped to [0, 1] (NaN -> 0)."""
        self._check_task(task)
        if (state.env, state.env_version, state.task_id) != (self.name, self.version, task.task_id):
            raise TaskEnvironmentError("episode state belongs to another task or environment version")
        return _clamp(float(self._guarded(lambda: self._final_reward(task, state))))

    def episode_reward(self, task: Task, env_seed: int, turns: Sequence[str]) -> float:
        """The reward of the episode the model played with `turns` (replayed from scratch)."""
        return self.replay(task, env_seed, turns).reward

    def reference_episode(self, task: Task, env_seed: int) -> tuple[str, ...]:
        """Model turns that play `task` correctly (SFT warm-up data); replaying them ends the
        episode with full reward (or the best the environment allows; tests check each)."""
        self._check_task(task)
        return tuple(self._reference_turns(task, env_seed))

    def reference_conversation(self, task: Task, env_seed: int) -> tuple[Message, ...]:
        """The reference episode as chat messages: prompt, assistant turns, environment replies."""
        return self.replay(task, env_seed, self.reference_episode(task, env_seed)).conversation(task)

    # -- single-turn entry points -----------------------------------------------------------------

    def _score(self, task: Task, completion: str) -> float:
        raise TaskEnvironmentError(
            f"{self.name} is multi-turn: grade an episode with episode_reward(task, env_seed, turns)")

    # -- what a subclass writes -------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except TaskEnvironmentError:
            raise
        except MemoryError as exc:
            raise UngradableError(f"{self.name}: the environment ran out of memory") from exc
        except Exception as exc:  # the environment's own code failed: no judgement of the turn
            log.warning("%s@%s: environment step failed with %r", self.name, self.version, exc)
            raise UngradableError(f"{self.name}: environment failed: {exc!r}") from exc

    @abstractmethod
    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        """The environment-specific state before the first turn."""

    @abstractmethod
    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        """Answer model turn number `turn` (0-based) saying `text`: (messages, done, new data, this
        turn's dense score or None). `data` is a deep copy of the state's: changing it in place cannot
        reach the earlier state."""

    @abstractmethod
    def _final_reward(self, task: Task, state: EpisodeState) -> float:
        """The episode's reward from its final state (clamped by the caller)."""

    @abstractmethod
    def _reference_turns(self, task: Task, env_seed: int) -> Sequence[str]:
        """The turns of a correct play."""
