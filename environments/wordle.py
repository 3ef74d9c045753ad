"""`wordle`: guess a hidden five-letter word from an in-repo list in at most six guesses.

Ported from the TextArena Wordle game verifiers wraps (its rule for feedback and partial credit),
with a fixed word list instead of nltk's corpus. Each model turn guesses: the last `<guess>...</guess>`
after `</think>` (an unclosed tag runs to the end), lower-cased and stripped. A guess that is not five
ASCII letters is answered "invalid" and still uses the turn. Feedback per letter, duplicates handled as
in Wordle (exact matches first, then each remaining letter of the word is claimed at most once):
`G` right letter, right place; `Y` in the word elsewhere; `X` not (or no more) in the word.

Reward: solved on guess k scores `1 - 0.1 * (k - 1)`; unsolved, partial credit
`0.5 * max over guesses of (greens + yellows / 2) / 5`. Any five-letter string is accepted as a
guess (a small model cannot know which words the list holds).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import JsonValue

from protocol.errors import TaskEnvironmentError

from .answers import last_tagged, strip_thinking
from .episode import EpisodeState, MultiTurnEnvironment
from .task import Message, Task, make_task

MAX_GUESSES = 6
LENGTH = 5

SYSTEM_PROMPT = (
    "Let's play Wordle. Guess the hidden five-letter English word in at most six guesses. Reply with "
    "one guess as <guess>word</guess>. After each guess you get one letter per position: G = right "
    "letter in the right place, Y = in the word but elsewhere, X = not in the word."
)

# A fixed list (part of the versioned generator): common five-letter words, lower-case, distinct.
WORDS: tuple[str, ...] = tuple("""
apple beach black bread brick brown chair chalk charm cheap chess chest child clock cloud coast
crane cream crown dance diary dream drink eagle earth fault field flame float flour focus forge
frost fruit ghost giant glass globe grape grass green heart honey horse house jelly juice knife
laugh lemon light lunar magic mango maple march metal money month mouse music night noble ocean
olive opera paint paper party peach pearl piano pilot plant plate point pound power quiet radio
raven river robot round royal salad scale scarf sheep shelf shirt shore skate sleep smile smoke
snake solar sound spoon sport stage steam stone storm sugar sunny table tiger toast tower train
trend truck uncle union value vivid voice water whale wheat wheel world yacht young zebra
""".split())


def feedback(guess: str, word: str) -> str:
    """The five-letter feedback (`G`/`Y`/`X`) for `guess` against `word` (both five lower-case letters)."""
    marks = ["X"] * LENGTH
    left: dict[str, int] = {}
    for i, (g, w) in enumerate(zip(guess, word, strict=True)):
        if g == w:
            marks[i] = "G"
        else:
            left[w] = left.get(w, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != "G" and left.get(g, 0) > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


def parse_guess(text: str) -> str | None:
    """The guess a turn makes, or None when it is not five ASCII letters."""
    raw = last_tagged(strip_thinking(text), "guess")
    if raw is None:
        return None
    guess = raw.strip().lower()
    return guess if len(guess) == LENGTH and guess.isascii() and guess.isalpha() else None


def _credit(marks: str) -> float:
    return (marks.count("G") + marks.count("Y") / 2) / LENGTH


class Wordle(MultiTurnEnvironment):
    """Wordle on an in-repo list; the hidden word is the task's answer (never in its messages)."""

    name = "wordle"
    version = "1"
    description = "five-letter Wordle, six guesses, in-repo word list; reward by guesses used, partial credit"
    max_turns = MAX_GUESSES

    def _generate(self, rng: random.Random) -> Task:
        return self.task_from("Guess the word.", rng.choice(WORDS))

    def task_from(self, question: str, answer: str) -> Task:
        word = answer.strip().lower()
        if len(word) != LENGTH or not (word.isascii() and word.isalpha()):
            raise TaskEnvironmentError(f"wordle answer must be five ASCII letters, got {answer!r}")
        messages = (Message(role="system", content=SYSTEM_PROMPT),
                    Message(role="user", content=f"{question} You have {MAX_GUESSES} guesses."))
        return make_task(self.name, self.version, messages, word)

    def _begin(self, task: Task, rng: random.Random) -> dict[str, JsonValue]:
        return {"solved_at": None}

    def _respond(self, task: Task, data: dict[str, JsonValue], turn: int, text: str,
                 rng: random.Random) -> tuple[Sequence[Message], bool, dict[str, JsonValue], float | None]:
        guess = parse_guess(text)
        left = MAX_GUESSES - turn - 1
        if guess is None:
            say = f"Invalid guess: reply with five letters as <guess>word</guess>. {left} guesses left."
            return [Message(role="user", content=say)], False, data, 0.0
        marks = feedback(guess, task.answer)
        if guess == task.answer:
            return (), True, {"solved_at": turn + 1}, 1.0
        say = f"{guess.upper()}: {' '.join(marks)}. {left} guesses left."
        return [Message(role="user", content=say)], False, data, _credit(marks)

    def _final_reward(self, task: Task, state: EpisodeState) -> float:
        solved_at = state.data.get("solved_at")
        if isinstance(solved_at, int):
            return 1.0 - 0.1 * (solved_at - 1)
        return 0.5 * max(state.turn_rewards, default=0.0)

    def _reference_turns(self, task: Task, env_seed: int) -> Sequence[str]:
        """Each guess is the first listed word consistent with all feedback so far (solves every listed
        word within six guesses; a test checks it). A word outside the list is guessed directly last."""
        seen: list[tuple[str, str]] = []
        turns: list[str] = []
        while len(turns) < MAX_GUESSES:
            candidates = [w for w in WORDS if all(feedback(g, w) == m for g, m in seen)]
            guess = candidates[0] if candidates and len(turns) < MAX_GUESSES - 1 else task.answer
            turns.append(f"<guess>{guess}</guess>")
            if guess == task.answer:
                break
            seen.append((guess, feedback(guess, task.answer)))
        return tuple(turns)
