"""Procedural function-writing problems: a statement, an entry point, hidden inputs, a reference.

Each family fills its parameters from the task's random stream and returns a `CodeProblem` whose
reference solution is our own (trusted) source text; expected outputs are computed by running that
reference in the generating process, never the candidate's code.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CodeProblem:
    """One problem before it becomes a `Task`."""

    statement: str
    entry_point: str
    reference: str
    inputs: list[list[Any]]


def _ints(rng: random.Random, n: int, lo: int = -50, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng: random.Random, lo: int = 1, hi: int = 8, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def sum_divisible(rng: random.Random) -> CodeProblem:
    k = rng.randint(2, 9)
    inputs = [[_ints(rng, rng.randint(0, 12))] for _ in range(8)] + [[[]], [[k, -k, 0]]]
    return CodeProblem(
        f"Write a Python function `sum_divisible(xs: list[int]) -> int` that returns the sum of the "
        f"elements of `xs` that are divisible by {k} (0 for an empty list).",
        "sum_divisible", f"def sum_divisible(xs):\n    return sum(x for x in xs if x % {k} == 0)\n", inputs)


def count_vowels(rng: random.Random) -> CodeProblem:
    vowels = "".join(sorted(rng.sample("aeiouy", rng.randint(3, 5))))
    letters = string.ascii_letters + " "
    inputs = [[_word(rng, 0, 20, letters)] for _ in range(8)] + [[""], [vowels.upper() + vowels]]
    return CodeProblem(
        f"Write a Python function `count_vowels(s: str) -> int` that counts the characters of `s` "
        f"that are one of the letters {', '.join(vowels)} (case-insensitive).",
        "count_vowels", f"def count_vowels(s):\n    return sum(1 for c in s.lower() if c in {vowels!r})\n",
        inputs)


def reverse_words(rng: random.Random) -> CodeProblem:
    sep = rng.choice([" ", ",", "-"])
    inputs = [[sep.join(_word(rng) for _ in range(rng.randint(1, 6)))] for _ in range(8)] + [[""]]
    return CodeProblem(
        f"Write a Python function `reverse_words(s: str) -> str` that splits `s` on {sep!r}, reverses "
        f"the order of the parts and joins them again with {sep!r}.",
        "reverse_words", f"def reverse_words(s):\n    return {sep!r}.join(reversed(s.split({sep!r})))\n",
        inputs)


def fizzbuzz_variant(rng: random.Random) -> CodeProblem:
    a, b = rng.sample([2, 3, 4, 5, 6, 7], 2)
    wa, wb = rng.sample(["Fizz", "Buzz", "Ping", "Pong", "Zap"], 2)
    inputs = [[rng.randint(1, 200)] for _ in range(10)] + [[a * b], [a], [b], [1]]
    return CodeProblem(
        f"Write a Python function `label(n: int) -> str` that returns {wa + wb!r} if `n` is divisible "
        f"by both {a} and {b}, {wa!r} if only by {a}, {wb!r} if only by {b}, and `str(n)` otherwise.",
        "label",
        f"def label(n):\n    if n % {a} == 0 and n % {b} == 0:\n        return {wa + wb!r}\n"
        f"    if n % {a} == 0:\n        return {wa!r}\n    if n % {b} == 0:\n        return {wb!r}\n"
        f"    return str(n)\n", inputs)


def fibonacci_mod(rng: random.Random) -> CodeProblem:
    m = rng.choice([7, 10, 97, 1000, 10007])
    inputs = [[n] for n in [0, 1, 2, *rng.sample(range(3, 500), 7)]]
    return CodeProblem(
        f"Write a Python function `fib_mod(n: int) -> int` that returns the n-th Fibonacci number "
        f"modulo {m}, where fib(0) = 0 and fib(1) = 1.",
        "fib_mod",
        f"def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n"
        f"    return a % {m}\n", inputs)


def running_max(rng: random.Random) -> CodeProblem:
    inputs = [[_ints(rng, rng.randint(0, 10))] for _ in range(9)]
    return CodeProblem(
        "Write a Python function `running_max(xs: list[int]) -> list[int]` that returns a list whose "
        "i-th element is the maximum of `xs[0..i]`.",
        "running_max",
        "def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
        "        best = x if best is None or x > best else best\n        out.append(best)\n    return out\n",
        inputs)


def rotate_list(rng: random.Random) -> CodeProblem:
    direction = rng.choice(["left", "right"])
    inputs = [[_ints(rng, rng.randint(0, 8)), rng.randint(0, 20)] for _ in range(9)]
    body = "xs[k:] + xs[:k]" if direction == "left" else "xs[-k:] + xs[:-k] if k else list(xs)"
    return CodeProblem(
        f"Write a Python function `rotate(xs: list[int], k: int) -> list[int]` that rotates `xs` to the "
        f"{direction} by `k` positions (`k` may exceed the length; an empty list stays empty).",
        "rotate", f"def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
        f"    return {body}\n", inputs)


def second_largest(rng: random.Random) -> CodeProblem:
    inputs = [[_ints(rng, rng.randint(0, 8), -9, 9)] for _ in range(9)] + [[[5, 5, 5]]]
    return CodeProblem(
        "Write a Python function `second_largest(xs: list[int]) -> int | None` that returns the second "
        "largest *distinct* value in `xs`, or None when there is none.",
        "second_largest",
        "def second_largest(xs):\n    d = sorted(set(xs))\n    return d[-2] if len(d) >= 2 else None\n",
        inputs)


def caesar(rng: random.Random) -> CodeProblem:
    shift = rng.randint(1, 25)
    inputs = [[_word(rng, 0, 15, string.ascii_letters + " !")] for _ in range(9)]
    return CodeProblem(
        f"Write a Python function `encode(s: str) -> str` that shifts every ASCII letter of `s` forward "
        f"by {shift} places in the alphabet (wrapping around, keeping case) and leaves other "
        "characters unchanged.",
        "encode",
        "def encode(s):\n    out = []\n    for c in s:\n        if 'a' <= c <= 'z':\n"
        f"            out.append(chr((ord(c) - 97 + {shift}) % 26 + 97))\n        elif 'A' <= c <= 'Z':\n"
        f"            out.append(chr((ord(c) - 65 + {shift}) % 26 + 65))\n        else:\n"
        "            out.append(c)\n    return ''.join(out)\n", inputs)


def digit_power_sum(rng: random.Random) -> CodeProblem:
    p = rng.randint(1, 4)
    inputs = [[rng.randint(0, 10**rng.randint(1, 9))] for _ in range(9)] + [[0]]
    return CodeProblem(
        f"Write a Python function `digit_power_sum(n: int) -> int` that returns the sum of the decimal "
        f"digits of the non-negative integer `n`, each raised to the power {p}.",
        "digit_power_sum",
        f"def digit_power_sum(n):\n    return sum(int(d) ** {p} for d in str(n))\n", inputs)


def run_length(rng: random.Random) -> CodeProblem:
    inputs = [["".join(rng.choice("ab") * rng.randint(1, 4) for _ in range(rng.randint(0, 5)))]
              for _ in range(9)]
    return CodeProblem(
        "Write a Python function `run_lengths(s: str) -> list[list]` that returns the run-length "
        "encoding of `s` as a list of `[character, count]` pairs, e.g. 'aab' -> [['a', 2], ['b', 1]].",
        "run_lengths",
        "def run_lengths(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
        "            out[-1][1] += 1\n        else:\n            out.append([c, 1])\n    return out\n",
        inputs)


FAMILIES: tuple[Callable[[random.Random], CodeProblem], ...] = (
    sum_divisible, count_vowels, reverse_words, fizzbuzz_variant, fibonacci_mod, running_max,
    rotate_list, second_largest, caesar, digit_power_sum, run_length,
)


def reference_outputs(problem: CodeProblem) -> list[Any]:
    """Expected outputs from the reference solution (our own source text, run in this process)."""
    namespace: dict[str, Any] = {}
    exec(compile(problem.reference, f"<reference {problem.entry_point}>", "exec"), namespace)  # trusted
    fn = namespace[problem.entry_point]
    return [fn(*args) for args in problem.inputs]
