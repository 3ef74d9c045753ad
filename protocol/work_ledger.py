"""The trainer's work ledger (its side of the audit): which work (validator work keys) each step consumed.

The trainer writes it (`WorkLedger`) and `prime-devnet audit` reads it (`read_work_ledger`), so the format
lives in `protocol`, beside the rollout files: one writer, one reader.

One JSON line per step, appended after the step and before its checkpoint (like the metrics, so a step
re-run after a crash is written twice with the same keys; a reader keeps the last line per step):

    {"step": 3, "time": 1700000000.0, "trained": ["0x..."], "stale": [], "future": [], "duplicate": [],
     "cursors": {"http://127.0.0.1:8700": 12}, "queued": ["0x..."]}

`trained` are the keys whose groups the step used (groups later filtered for having no signal
included: the step consumed them); `stale`/`future` were dropped by the async window, `duplicate`
groups identical to ones already trained (a replayed cache). `cursors` is,
per validator, the feed seq up to which every item is done; `queued` the keys fetched but not
consumed yet. `prime-devnet audit` reads it: every accepted work key must be trained (or dropped
with a reason) in some step, or still queued (fetched, or past the cursor of its validator's feed).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class WorkLedger:
    """Appends a step's work keys to a JSON-lines file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, step: int, work: dict[str, list[str]], source: Any) -> None:
        cursors = getattr(source, "cursors", None)
        queued = getattr(source, "queued", None)
        line = {
            "step": step,
            "time": round(time.time(), 3),
            "trained": list(work.get("trained", [])),
            "stale": list(work.get("stale", [])),
            "future": list(work.get("future", [])),
            "duplicate": list(work.get("duplicate", [])),
            "cursors": cursors() if callable(cursors) else {},
            "queued": queued() if callable(queued) else [],
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(line, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def read_work_ledger(path: Path) -> dict[int, dict[str, Any]]:
    """The last line of every step (a torn last line, from a crash mid-write, is skipped); empty when the file
    cannot be read (no step written yet)."""
    return read_step_lines(path)


def read_step_lines(path: Path) -> dict[int, dict[str, Any]]:
    """Any JSON-lines file the trainer appends one line per step to (the work ledger, the metrics file), by
    step: the last line of each step wins (a step re-run after a crash is written twice), a torn or foreign
    line is skipped, and a file that cannot be read gives nothing."""
    steps: dict[int, dict[str, Any]] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return steps
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
            steps[int(line["step"])] = line
        except (ValueError, KeyError, TypeError):
            continue
    return steps
