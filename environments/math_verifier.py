"""Mathematical equivalence through `math-verify`, in a worker process, safe from any thread.

Every check goes to a long-lived worker subprocess (`python -I environments/math_worker.py`) that
runs `equivalent()` on its own main thread. Two budgets, and whose fault each is:

- CPU time (`cpu_budget_s`, ITIMER_PROF in the worker, plus RLIMIT_AS `memory_bytes`): spent by the
  *answer* (a power tower, 3,000 nested parentheses). CPU time does not depend on how loaded the
  grader is, so an answer that exhausts it is judged not equivalent (reward 0) on every machine.
- Wall time (`hard_timeout_s` per check): if the worker has not answered by then and has used less CPU than its
  budget, the grader was starved (overloaded), so the check is `UngradableError`, not a 0. If it did
  burn its CPU budget (stuck in uninterruptible C code), the answer is at fault: 0. Either way the
  worker is killed and restarted.

A worker that cannot start within `start_timeout_s`, dies, or breaks its protocol is likewise
`UngradableError`. Why not call math-verify in-process: its own timeouts are wall-clock `signal.alarm`
(main thread only, and load-dependent), and a process-wide CPU timer would charge the answer for the
host's other threads. The worker costs ~2% in throughput (see the README's bench).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from protocol.canonical import parse_json
from protocol.errors import ProtocolError, UngradableError

log = logging.getLogger(__name__)

MAX_PRED_CHARS = 4096
"""Only the tail of a completion is parsed: the final answer sits at the end."""
MAX_GOLD_CHARS = 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def equivalent(gold: str, completion_tail: str) -> bool:
    """True when the completion's final answer equals `gold` (a LaTeX expression) mathematically.

    No timeouts of its own (math-verify's are wall-clock alarms): the caller bounds it, as the worker
    does with a CPU-time budget.
    """
    from math_verify import parse, verify  # imported lazily: sympy costs ~1 s at import

    gold_parsed = parse("\\boxed{" + gold[:MAX_GOLD_CHARS] + "}", parsing_timeout=None)
    if not gold_parsed:
        return False
    pred_parsed = parse(completion_tail[-MAX_PRED_CHARS:], parsing_timeout=None)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class _Worker:
    """One `math_worker.py` subprocess; JSON lines in, JSON lines out."""

    def __init__(self, cpu_budget_s: float, memory_bytes: int, start_timeout_s: float) -> None:
        script = Path(__file__).with_name("math_worker.py")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(script), str(cpu_budget_s), str(memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError as exc:
            raise UngradableError(f"math worker could not start: {exc}") from exc
        self._buf = b""
        try:
            if self._reply(start_timeout_s) != {"ready": True}:
                raise UngradableError("math worker sent a bad greeting")
        except TimeoutError:
            self.kill()
            raise UngradableError(f"math worker did not start within {start_timeout_s} s") from None
        except BaseException:
            self.kill()
            raise

    def _reply(self, timeout_s: float) -> object:
        """The worker's next line, parsed; `UngradableError` if it dies, overruns or sends garbage."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise UngradableError(f"math worker died (exit {self.proc.wait()})")
                self._buf += chunk
                if len(self._buf) > 65536:
                    raise UngradableError("math worker sent an oversize line")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return parse_json(line)
        except ProtocolError as exc:
            raise UngradableError(f"math worker sent a malformed line: {exc}") from exc

    def ask(self, gold: str, tail: str, timeout_s: float, cpu_budget_s: float) -> bool:
        """The worker's verdict (see the module docstring for who is at fault when it has none).
        A worker left mid-check (overrun, failed) is killed before this returns or raises."""
        try:
            return self._ask(gold, tail, timeout_s, cpu_budget_s)
        except BaseException:
            self.kill()
            raise

    def _ask(self, gold: str, tail: str, timeout_s: float, cpu_budget_s: float) -> bool:
        assert self.proc.stdin is not None
        try:
            cpu_before = _cpu_s(self.proc.pid)
            # ASCII-escaped: an answer may hold lone surrogates, which UTF-8 cannot encode.
            self.proc.stdin.write(json.dumps({"gold": gold, "pred": tail}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise UngradableError(f"math worker is gone: {exc}") from exc
        try:
            reply = self._reply(timeout_s)
        except TimeoutError:
            try:
                used = _cpu_s(self.proc.pid) - cpu_before
            except OSError:
                used = 0.0
            self.kill()
            if used >= cpu_budget_s:  # burning its budget in code that signals could not interrupt
                log.info("math check used %.1f s of CPU without finishing: scored as not equivalent", used)
                return False
            raise UngradableError(f"math worker got {used:.2f} s of CPU in {timeout_s:.0f} s of wall time: "
                                  "the grader is overloaded") from None
        if isinstance(reply, dict) and isinstance(reply.get("ok"), bool):
            return bool(reply["ok"])  # a reply with "limit" set is ok=False: the answer used up its budget
        raise UngradableError(f"math worker failed: {str(reply)[:200]}")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


class MathVerifier:
    """Thread-safe front door to one worker subprocess (checks are serialized)."""

    def __init__(self, hard_timeout_s: float = 30.0, cpu_budget_s: float = 4.0,
                 memory_bytes: int = 2 * 2**30, start_timeout_s: float = 60.0) -> None:
        self.hard_timeout_s = hard_timeout_s
        """Wall time for the worker to answer one check."""
        self.start_timeout_s = start_timeout_s
        """Wall time for a worker to start (interpreter, sympy and math-verify imports)."""
        self.cpu_budget_s = cpu_budget_s
        """CPU seconds one check may use; past it the answer is not equivalent."""
        self.memory_bytes = memory_bytes
        """RLIMIT_AS of the worker: an answer that needs more is not equivalent."""
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def check(self, gold: str, completion_tail: str) -> bool:
        """Equivalence of `completion_tail`'s final answer with `gold`; `UngradableError` when the
        check itself could not be done (see the module docstring)."""
        tail = completion_tail[-MAX_PRED_CHARS:]
        gold = gold[:MAX_GOLD_CHARS]
        with self._lock:
            if self._worker is None or self._worker.proc.poll() is not None:
                self._worker = _Worker(self.cpu_budget_s, self.memory_bytes, self.start_timeout_s)
            try:
                return self._worker.ask(gold, tail, self.hard_timeout_s, self.cpu_budget_s)
            except UngradableError as exc:
                log.warning("math check could not be done (%s); the worker restarts on the next one", exc)
                raise
            finally:
                if self._worker.proc.poll() is not None:  # killed by ask(): start afresh next time
                    self._worker = None

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
