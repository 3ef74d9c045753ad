"""Mathematical equivalence through `math-verify`, safe to call from any thread.

`math-verify` bounds parsing and comparison with `signal.alarm`, which works only in a process's
main thread (elsewhere it raises, or with timeouts off it can hang on inputs like `9^{9^{9^9}}`).
So: on the main thread we call it in-process with its timeouts on; on any other thread (an asyncio
executor, a validator worker pool) we send the pair to a long-lived worker subprocess
(`python -I environments/math_worker.py`) that runs the same function on *its* main thread, and
kill and restart it if it overruns `hard_timeout_s`. Both paths run `equivalent()` below, so they
agree; a pair that times out scores as not equivalent (only adversarial inputs get near the limit).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 2
MAX_PRED_CHARS = 4096
"""Only the tail of a completion is parsed: the final answer sits at the end."""
MAX_GOLD_CHARS = 1024


def equivalent(gold: str, completion_tail: str, *, timeouts: bool = True) -> bool:
    """True when the completion's final answer equals `gold` (a LaTeX expression) mathematically."""
    from math_verify import parse, verify  # imported lazily: sympy costs ~1 s at import

    pt = PARSE_TIMEOUT_S if timeouts else None
    vt = VERIFY_TIMEOUT_S if timeouts else None
    gold_parsed = parse("\\boxed{" + gold[:MAX_GOLD_CHARS] + "}", parsing_timeout=pt)
    if not gold_parsed:
        return False
    pred_parsed = parse(completion_tail[-MAX_PRED_CHARS:], parsing_timeout=pt)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=vt))


class _Worker:
    """One `math_worker.py` subprocess; JSON lines in, JSON lines out."""

    def __init__(self) -> None:
        script = Path(__file__).with_name("math_worker.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True)
        self._buf = b""

    def ask(self, gold: str, tail: str, deadline_s: float) -> bool | None:
        """The worker's verdict, or None when it died or overran (the caller then kills it)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"gold": gold, "pred": tail}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + deadline_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return bool(json.loads(line)["ok"])
        except (ValueError, KeyError, TypeError):
            return None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


class MathVerifier:
    """Thread-safe front door: in-process on the main thread, else a worker subprocess."""

    def __init__(self, hard_timeout_s: float = 30.0) -> None:
        self.hard_timeout_s = hard_timeout_s
        """Wall time a worker gets per pair (covers sympy import on first use) before it is killed."""
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def check(self, gold: str, completion_tail: str) -> bool:
        """Equivalence of `completion_tail`'s final answer with `gold`."""
        tail = completion_tail[-MAX_PRED_CHARS:]
        gold = gold[:MAX_GOLD_CHARS]
        if threading.current_thread() is threading.main_thread():
            try:
                return equivalent(gold, tail)
            except Exception as exc:  # math-verify/sympy raise a zoo of types on odd input
                log.debug("math-verify failed in-process: %r", exc)
                return False
        with self._lock:
            if self._worker is None or self._worker.proc.poll() is not None:
                self._worker = _Worker()
            verdict = self._worker.ask(gold, tail, self.hard_timeout_s)
            if verdict is None:
                log.warning("math worker overran %.0f s or died; restarting it", self.hard_timeout_s)
                self._worker.kill()
                self._worker = None
                return False
            return verdict

    def close(self) -> None:
        """Stop the worker subprocess, if one is running."""
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.kill()
