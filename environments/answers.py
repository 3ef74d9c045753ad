"""Pulling the final answer out of free-form model text: tags, `\\boxed{}`, last number.

Shared by the reverse-text, arithmetic and math environments. Every function here is linear in the
input (no backtracking regexes over unbounded text), so a 10 MB completion costs milliseconds.
"""

from __future__ import annotations

import re
from fractions import Fraction

_THINK_CLOSE = "</think>"
_NUMBER = re.compile(r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def strip_thinking(text: str) -> str:
    """Drop a reasoning block: everything up to the last `</think>` (if the model wrote one)."""
    cut = text.rfind(_THINK_CLOSE)
    return text[cut + len(_THINK_CLOSE):] if cut >= 0 else text


def last_tagged(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>` pair, or of a trailing unclosed `<tag>...`; else None."""
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    start = text.rfind(open_t)
    if start < 0:
        return None
    end = text.find(close_t, start)
    return text[start + len(open_t): end if end >= 0 else len(text)]


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent/unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` (integers, `1,234`, decimals, `a/b`), as an exact Fraction."""
    # Scan a bounded tail (trailing whitespace dropped): the final answer is at the end, and a
    # regex over 10 MB is wasted work. Documented rule: the last number in the last 4096 characters.
    matches = _NUMBER.findall(text.rstrip()[-4096:])
    for raw in reversed(matches):
        value = parse_number(raw)
        if value is not None:
            return value
    return None


def parse_number(raw: str) -> Fraction | None:
    """`'-1,234.50'` -> Fraction; `'3/4'` -> Fraction(3, 4); None when it is not one number."""
    s = raw.strip().replace("−", "-").replace(",", "").replace(" ", "")
    if s.startswith("$") and s.endswith("$") and len(s) >= 2:
        s = s[1:-1]
    if len(s) > 64 or not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(Fraction(num), Fraction(den)) if Fraction(den) != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
