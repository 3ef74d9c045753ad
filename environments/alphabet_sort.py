"""`alphabet-sort`: sort names, then re-sort the growing list as a scripted user adds names each turn.

Ported from verifiers' `alphabet_sort` environment (names from an in-repo list instead of a dataset
download). A task holds 2-3 batches of names: the prompt gives the first (2-4 names), each later user
turn adds 1-2. Every model turn must reply with the whole list so far, sorted, one name per line,
inside `<names>...</names>` (the last such tag after `</think>`; an unclosed one runs to the end).

Dense reward: each turn scores `similarity ** POWER`, similarity being the ratio of matching names in
order (`difflib.SequenceMatcher` over the name lists, autojunk off: 2 * matches / total); the episode's
reward is the mean over all the task's turns, so a turn never played counts 0. The order in which the
user lists the new names is drawn from the episode's seed (sorting does not depend on it).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Sequence

from pydantic import JsonValue

from protocol.errors import TaskEnvironmentError

from .answers import last_tagged, strip_thinking
from .episode import EpisodeState, MultiTurnEnvironment
from .task import Message, Task, make_task

POWER = 4
MAX_LINES = 64

SYSTEM_PROMPT = (
    "Sort the names alphabetically. Reply with the complete sorted list, one name per line, inside "
    "<names></names> tags. When the user adds names, reply with the whole list again, sorted."
)

# A fixed list (part of the versioned generator): short, distinct, capitalized ASCII names.
NAMES: tuple[str, ...] = tuple("""
Ada Alan Alice Amir Anna Arlo Asha Ben Bruno Carl Chen Clara Dana Dev Diego Dora Eli Elsa Emil
Erin Eva Felix Fern Finn Gaia Gil Greta Hana Hugo Ian Ida Igor Ines Ivan Jade Jan Jin Jonas Kai
Kara Kim Lars Lea Leo Lina Luca Luz Maya Mia Milo Nadia Nia Nico Nils Noah Nora Olga Omar Otto
Paul Pia Quinn Raj Rosa Ruth Sam Sara Saul Tara Teo Tom Uma Ugo Vera Vik Wes Willa Xavi Yara Yuki
Yusuf Zane Zara Zoe
""".split())


def parse_names(text: str) -> list[str]:
    """The names a turn lists: lines of the last `<names>` block (stripped, empty lines dropped)."""
    block = last_tagged(strip_thinking(text), "names")
    if block is None:
        return []
    lines = (line.strip(" \t\r,.-*") for line in block.split("\n", MAX_LINES)[:MAX_LINES])
    return [line for line in lines if line]


def similarity(got: Sequence[str], want: Sequence[str]) -> float:
    """2 * (names matched in order) / (len(got) + len(want)); 1.0 only for an exact list."""
    if not got and not want:
        return 1.0
    return difflib.SequenceMatcher(None, list(got), list(want), autojunk=False).ratio()


class AlphabetSort(MultiTurnEnvironment):
    """A scripted user adds names; the model re-sorts the cumulative list each turn."""

    name = "alphabet-sort"
    version = "1"
    description = "sort names, re-sort as a scripted user adds more (2-3 turns); dense similarity reward"
    max_turns = 3

    def _generate(self, rng: random.Random) -> Task:
        n_turns = rng.randint(2, self.max_turns)
        sizes = [rng.randint(2, 4)] + [rng.randint(1, 2) for _ in range(n_turns - 1)]
        chosen = rng.sample(NAMES, sum(sizes))
        batches, at = [], 0
        for size in sizes:
            batches.append(chosen[at:at + size])
            at += size
        return self._task(batches)

    def _task(self, batches: list[list[str]]) -> Task:
        question = "Sort these names: " + ", ".join(batches[0])
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question))
        everything = sorted(n for batch in batches for n in batch)
        info: dict[str, JsonValue] = {"batches": [list(b) for b in batches]}
        return make_task(self.name, self.version, messages, "\n".join(everything), info=info)

    def task_from(self, question: str, answer: str) -> Task:
        """`question`: batches separated by `;`, names by `,` (e.g. `Eva, Ada; Bo`); `answer` is ignored
        (it is always the sorted union)."""
        batches = [[n.strip() for n in part.split(",") if n.strip()] for part in question.split(";")]
        if not batches or any(not b for b in batches) or len(batches) > self.max_turns:
            raise TaskEnvironmentError(f"alphabet-sort question must be 1-{self.max_turns} ';'-separated "
                                       f"batches of ','-separated names, got {question!r}")
        return self._task(batches)

    @staticmethod
    def _batches(task: Task) -> list[list[str]]:
        raw = task.info.get("batches")
        if not isinstance(raw, list) or not all(isinstance(b, list) for b in raw):
            raise TaskEnvironmentError("alphabet-sort task has no name batches")
        return [[str(n) for n in b] for b in raw]  # type: ignore[union-attr]

    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        return {}

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        batches = self._batches(task)
        want = sorted(n for batch in batches[:turn + 1] for n in batch)
        score = similarity(parse_names(text), want) ** POWER
        if turn + 1 >= len(batches):
            return (), True, data, score
        new = list(batches[turn + 1])
        rng.shuffle(new)
        plural = "these names" if len(new) > 1 else "this name"
        say = f"Now add {plural}: {', '.join(new)}. Reply with the whole list, sorted."
        return [Message(role="user", content=say)], False, data, score

    def _final_reward(self, task: Task, state: EpisodeState) -> float:
        return sum(state.turn_rewards) / len(self._batches(task))

    def _reference_turns(self, task: Task, env_seed: int) -> Sequence[str]:
        batches = self._batches(task)
        return tuple("<names>\n" + "\n".join(sorted(n for b in batches[:k + 1] for n in b)) + "\n</names>"
                     for k in range(len(batches)))
