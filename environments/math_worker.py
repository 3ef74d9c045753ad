"""Worker for `math_verifier.MathVerifier`: runs `equivalent()` on its own main thread.

Usage: `python -I math_worker.py <cpu_budget_s> <memory_bytes>`. It imports math-verify (sympy)
first and says `{"ready": true}`; then one JSON object per line on stdin, `{"gold": str, "pred":
str}`, and one reply per line on stdout: `{"ok": bool}`, `{"ok": false, "limit": "cpu" | "memory"}`
when the answer exhausted a budget (its own fault), or `{"error": "..."}` when the check itself
failed (the grader's: `UngradableError`). Started with `python -I`, so it imports `math_verifier`
by file path, not package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import resource
import signal
import sys
from pathlib import Path
from types import FrameType


class CpuBudgetExceeded(BaseException):
    """Raised from SIGPROF; a BaseException so math-verify's `except Exception` cannot swallow it."""


def _on_budget(signum: int, frame: FrameType | None) -> None:
    raise CpuBudgetExceeded


def main() -> None:
    logging.disable(logging.CRITICAL)  # math-verify warns about disabled timeouts; stderr goes nowhere
    cpu_budget_s, memory_bytes = float(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    spec = importlib.util.spec_from_file_location("math_verifier", Path(__file__).with_name("math_verifier.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.equivalent("1", "\\boxed{1}")  # import sympy and math-verify now, outside any check's budget
    signal.signal(signal.SIGPROF, _on_budget)
    _say({"ready": True})
    for line in sys.stdin:
        reply: dict[str, object]
        try:
            req = json.loads(line)
            # Process CPU time (this process is single-threaded): independent of the host's load.
            # The interval re-raises if some `except BaseException` in sympy swallowed the first one.
            signal.setitimer(signal.ITIMER_PROF, cpu_budget_s, 0.25)
            try:
                reply = {"ok": bool(module.equivalent(str(req["gold"]), str(req["pred"])))}
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except CpuBudgetExceeded:
            reply = {"ok": False, "limit": "cpu"}
        except MemoryError:  # RLIMIT_AS: the answer's expression outgrew the budget
            reply = {"ok": False, "limit": "memory"}
        except Exception as exc:  # our own failure, not a judgement of the answer
            reply = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        _say(reply)


def _say(reply: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
