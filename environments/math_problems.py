"""Procedural competition-style problems with LaTeX reference answers (no dataset download needed).

Each family draws its numbers from the task's random stream and returns (question, answer). The
answers are what `math-verify` compares against: reduced fractions as `\\frac{p}{q}`, radicals as
`a\\sqrt{b}`, multiples of pi as `k\\pi`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction


def latex(value: Fraction) -> str:
    """`Fraction(-3, 4)` -> `-\\frac{3}{4}`; integers stay integers."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def fraction_sum(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    op = rng.choice("+-")
    value = Fraction(a, b) + Fraction(c, d) if op == "+" else Fraction(a, b) - Fraction(c, d)
    return (f"Compute $\\frac{{{a}}}{{{b}}} {op} \\frac{{{c}}}{{{d}}}$ and write the result as a "
            "fraction in lowest terms.", latex(value))


def linear_equation(rng: random.Random) -> tuple[str, str]:
    a = rng.choice([k for k in range(-9, 10) if k not in (0, 1)])
    b, c = rng.randint(-30, 30), rng.randint(-30, 30)
    return f"Solve for $x$: ${a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}$.", latex(Fraction(c - b, a))


def quadratic_root(rng: random.Random) -> tuple[str, str]:
    r1, r2 = rng.randint(-12, 12), rng.randint(-12, 12)
    while r2 == r1:
        r2 = rng.randint(-12, 12)
    s, p = -(r1 + r2), r1 * r2
    poly = "x^2" + (f" {'+' if s >= 0 else '-'} {abs(s)}x" if s else "") + (
        f" {'+' if p >= 0 else '-'} {abs(p)}" if p else "")
    return f"What is the larger root of ${poly} = 0$?", str(max(r1, r2))


def circle_area(rng: random.Random) -> tuple[str, str]:
    r = rng.randint(2, 15)
    return (f"A circle has radius {r}. What is its area? Express your answer in terms of $\\pi$.",
            f"{r * r}\\pi")


def simplify_radical(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    return f"Simplify $\\sqrt{{{a * a * b}}}$.", f"{a}\\sqrt{{{b}}}"


def dice_probability(rng: random.Random) -> tuple[str, str]:
    total = rng.randint(2, 12)
    ways = sum(1 for i in range(1, 7) for j in range(1, 7) if i + j == total)
    return (f"Two fair six-sided dice are rolled. What is the probability that the sum is {total}? "
            "Express your answer as a common fraction.", latex(Fraction(ways, 36)))


def series_sum(rng: random.Random) -> tuple[str, str]:
    first, step, count = rng.randint(1, 20), rng.randint(1, 9), rng.randint(5, 40)
    last = first + step * (count - 1)
    return (f"Find the sum $ {first} + {first + step} + {first + 2 * step} + \\cdots + {last}$.",
            str(count * (first + last) // 2))


def binomial(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(5, 16)
    k = rng.randint(2, n - 2)
    return f"Compute $\\dbinom{{{n}}}{{{k}}}$.", str(math.comb(n, k))


def lcm_pair(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    return f"What is the least common multiple of {a} and {b}?", str(a * b // math.gcd(a, b))


def system_solution(rng: random.Random) -> tuple[str, str]:
    x, y = rng.randint(-15, 15), rng.randint(-15, 15)
    a, b = rng.randint(1, 5), rng.randint(1, 5)
    return (f"If $x + y = {x + y}$ and ${a}x - {b}y = {a * x - b * y}$, what is $x$?", str(x))


def percent_of(rng: random.Random) -> tuple[str, str]:
    p, n = rng.choice([5, 12, 15, 25, 35, 40, 75, 120]), rng.randint(2, 80) * 10
    return f"What is {p}\\% of {n}?", latex(Fraction(p * n, 100))


def exponent_rule(rng: random.Random) -> tuple[str, str]:
    base = rng.choice([2, 3, 5])
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 6)
    return f"Compute ${base}^{{{a}}} \\cdot {base}^{{{b}}} \\div {base}^{{{a + b - c}}}$.", str(base ** c)


FAMILIES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    fraction_sum, linear_equation, quadratic_root, circle_area, simplify_radical, dice_probability,
    series_sum, binomial, lcm_pair, system_solution, percent_of, exponent_rule,
)
