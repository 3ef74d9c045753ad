"""`reverse-text`: reverse a short string; reward = character-level similarity to the exact reversal.

Small enough for a 135M model to learn in a few hundred GRPO steps (the local demo's task), and
graded with partial credit (1 - normalized Levenshtein distance) so early, almost-right answers
already give the policy a gradient.

Answer extraction (documented contract, versioned with the environment):
1. drop everything up to the last `</think>`;
2. if an `<answer>` tag is present, take the content of the last one (closed or not);
   otherwise take the whole remaining text;
3. strip surrounding whitespace.
An extracted answer longer than `MAX_ANSWER_CHARS` scores 0 (its similarity would be under 0.1
anyway, and the bound keeps grading O(len(target)) on 10 MB completions).
"""

from __future__ import annotations

import random

from .answers import last_tagged, strip_thinking
from .base import Environment
from .task import Message, Task, make_task

MAX_ANSWER_CHARS = 512

SYSTEM_PROMPT = (
    "Reverse the text the user gives you, character by character. "
    "Reply with only the reversed text inside <answer></answer> tags."
)

# A fixed word list (part of the versioned generator): short, common, lower-case ASCII words.
WORDS: tuple[str, ...] = tuple("""
apple river stone cloud green light house table water bread music paper chair plant smile dream
ocean tiger horse lemon grape mango piano robot pixel delta gamma omega alpha sigma north south east
west red blue gold silver sun moon star rain snow wind fire ice sand rock tree leaf seed root bird
fish wolf bear lion frog duck cat dog owl bee ant cup pen map key box bag hat car bus ship train
plane road city town park lake hill farm barn gate door wall roof room bed lamp clock book page word
line dot code data byte node link path file time day week year night noon dawn dusk hope calm bold
fast slow warm cold soft hard dark bright quiet loud happy brave small large tiny vast young old new
""".split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1), O(len(a) * len(b)) time."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def similarity(candidate: str, target: str) -> float:
    """1 - levenshtein / max(len): 1.0 for an exact match, 0.0 for nothing in common."""
    longest = max(len(candidate), len(target))
    return 1.0 if longest == 0 else 1.0 - levenshtein(candidate, target) / longest


def extract_answer(completion: str) -> str:
    """The answer part of a completion (see the module docstring for the rule)."""
    text = strip_thinking(completion)
    tagged = last_tagged(text, "answer")
    return (tagged if tagged is not None else text).strip()


class ReverseText(Environment):
    """Reverse 5-20 characters of common words."""

    name = "reverse-text"
    version = "1"
    description = "reverse a short string; reward 1 - normalized Levenshtein distance"

    min_chars = 5
    max_chars = 20

    def _generate(self, rng: random.Random) -> Task:
        # Words until the string is long enough, then cut to the drawn length (mid-word cuts are
        # fine: the task is character reversal). Never ends in a space, so length >= min_chars.
        target_len = rng.randint(self.min_chars + 1, self.max_chars)
        joined = rng.choice(WORDS)
        while len(joined) < target_len:
            joined += " " + rng.choice(WORDS)
        text = joined[:target_len]
        if text.endswith(" "):
            text = text[:-1]
        return self.task_from(text, text[::-1])

    def task_from(self, question: str, answer: str) -> Task:
        messages = (Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question))
        return make_task(self.name, self.version, messages, answer)

    def reference_completion(self, task: Task) -> str:
        """The exact reversal in the answer tags the system prompt asks for."""
        self._check_task(task)
        return f"<answer>{task.answer}</answer>"

    def _score(self, task: Task, completion: str) -> float:
        answer = extract_answer(completion)
        if len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        return similarity(answer, task.answer)
