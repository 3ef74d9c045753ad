"""Known-answer table for reverse-text: exact, partial, tagged, thinking, adversarial."""

from __future__ import annotations

import time

import pytest

import environments
from environments.reverse_text import extract_answer, levenshtein, similarity

ENV = environments.get("reverse-text")
TASK = ENV.task_from("hello world", "dlrow olleh")

CASES: list[tuple[str, float]] = [
    ("dlrow olleh", 1.0),
    ("  dlrow olleh \n", 1.0),
    ("<answer>dlrow olleh</answer>", 1.0),
    ("<answer> dlrow olleh </answer>", 1.0),
    ("Sure!\n<answer>dlrow olleh</answer>", 1.0),
    ("<answer>wrong</answer> then <answer>dlrow olleh</answer>", 1.0),
    ("<answer>dlrow olleh", 1.0),                                   # unclosed final tag
    ("<think>hmm hello world</think><answer>dlrow olleh</answer>", 1.0),
    ("<think>x</think>dlrow olleh", 1.0),
    ("dlrow olle", 1 - 1 / 11),                                     # one deletion
    ("dlrow ollehh", 1 - 1 / 12),                                   # one insertion
    ("dlrow ollex", 1 - 1 / 11),                                    # one substitution
    ("Dlrow olleh", 1 - 1 / 11),                                    # case matters
    ("dlrowolleh", 1 - 1 / 11),
    ("hello world", 1 - 8 / 11),                                    # not reversed at all
    ("", 0.0),
    ("<answer></answer>", 0.0),
    ("x", 0.0),
    ("dlrow", 5 / 11),
    ("olleh", 5 / 11),
    ("dlrow olleh dlrow olleh", 11 / 23),
    ("DLROW OLLEH", 1 - 10 / 11),
    ("<answer>dlrow olleh</answer> trailing talk", 1.0),
    ("<ANSWER>dlrow olleh</ANSWER>", 1 - 17 / 28),                  # tags are case-sensitive
    ("\tdlrow olleh\t", 1.0),
    ("d l r o w", 1 - 8 / 11),
    ("dlrow olleh" + "!" * 600, 0.0),                               # answer over 512 chars
    ("x" * 10_000_000, 0.0),                                        # 10 MB: bounded, not a hang
    ("<answer>" + "y" * 10_000_000, 0.0),
    ("<think>" + "z" * 5_000_000 + "</think>dlrow olleh", 1.0),
    ("\u202edlrow olleh", 1 - 1 / 12),                              # RTL override is a character
    ("dlrow\nolleh", 1 - 1 / 11),
]


@pytest.mark.parametrize(("completion", "expected"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_known_answers(completion: str, expected: float) -> None:
    started = time.monotonic()
    assert ENV.reward(TASK, completion) == pytest.approx(expected, abs=1e-9)
    assert time.monotonic() - started < 30  # a generous bound: 10 MB must never hang the grader


def test_table_size() -> None:
    assert len(CASES) >= 30


def test_levenshtein_basics() -> None:
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0
    assert similarity("", "") == 1.0


def test_extract_answer_rule() -> None:
    assert extract_answer("<think>a</think> <answer> b </answer>") == "b"
    assert extract_answer("plain") == "plain"


def test_sampled_tasks_are_learnable_sized() -> None:
    for task in ENV.sample(7, 200):
        text = task.question()
        assert 5 <= len(text) <= 20 and text == text.strip()
        assert task.answer == text[::-1]
        assert ENV.reward(task, f"<answer>{task.answer}</answer>") == 1.0
